"""The expiry index: results, groups and chords by the hour they were written.

Every write of a done node, a saved group or a chord counter creates its
entry ``expiry/h{hour}/{shard}/{kind}~{id}`` in the same transaction, so there
is never a node cleanup cannot find; :meth:`ExpiryIndex.cleanup` reads only
the hours past the cutoff, never the done area. A chunked result's container
has entries of its own (``p~...``) and is deleted unless a live node still
points at it (:meth:`ExpiryIndex._expire_payloads`). See ``docs/backend.md``,
"Expiry and cleanup" and "Large results: chunks".
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoNodeError, NotEmptyError
from kazoo.protocol.paths import join

from ..exceptions import PayloadError
from ..zk.client import (
    CONNECTION_ERRORS,
    children,
    delete_if_there,
    listings,
    multi_failure,
    reply_or_retry,
)
from ..zk.layout import Layout
from ..zk.names import PayloadName
from ..zk.payload import (
    Manifest,
    chunk_paths,
    commit_deleting,
    delete_container,
    deleting,
    is_manifest,
    parse_manifest,
)

__all__ = ["CHORD", "GROUP", "HOUR", "RESULT", "ExpiryIndex", "Key", "bucket_expired",
           "expiry_hour"]

RESULT, GROUP, CHORD = "r", "g", "c"  # the kinds of node an index entry points at
HOUR = 3600
BATCH = 200        # deletes per multi transaction
SHARD_GROUP = 32   # shards cleaned per pipelined round


class Key(NamedTuple):
    """What Celery's key/value protocol calls a key: a kind and an id."""

    kind: str
    id: str


def expiry_hour(timestamp: float) -> int:
    """The index bucket a node written at ``timestamp`` goes in."""
    return int(timestamp // HOUR)


def bucket_expired(hour: int, cutoff: float) -> bool:
    """True when everything written in ``hour`` is older than ``cutoff``."""
    return (hour + 1) * HOUR <= cutoff


class ExpiryIndex:
    """Deletes what the index says expired; the backend writes the entries."""

    def __init__(self, client: Callable[[], KazooClient], layout: Layout,
                 path_of: Callable[[Key], str], delete: Callable[[Key], None]) -> None:
        self._client = client  # a callable: the backend's client is made per process
        self.layout = layout
        self._path_of = path_of
        self._delete_key = delete  # removes a chord counter with its parts

    @property
    def client(self) -> KazooClient:
        return self._client()

    def cleanup(self, cutoff: float) -> int:
        """Delete nodes last written before ``cutoff``; returns how many.

        A node is deleted only if it was last modified before the cutoff, and
        with its version as read: one rewritten since has a newer entry that
        will expire it later.
        """
        client = self.client
        removed = 0
        for name in sorted(children(client, self.layout.expiry)):
            hour = self.layout.parse_expiry_bucket(name)
            if hour is None or not bucket_expired(hour, cutoff):
                continue
            removed += self._cleanup_bucket(hour, cutoff)
        return removed

    def _cleanup_bucket(self, hour: int, cutoff: float) -> int:
        client = self.client
        bucket = self.layout.expiry_bucket(hour)
        shards = [self.layout.expiry_shard(hour, shard)
                  for shard in client.retry(client.get_children, bucket)]
        removed = 0
        # A few shards at a time, each step pipelined over all of them: the cost is
        # a handful of round trips per group, not several per shard or per entry.
        for start in range(0, len(shards), SHARD_GROUP):
            group = shards[start:start + SHARD_GROUP]
            entries: list[str] = []
            keys: list[Key] = []
            payloads: list[PayloadName] = []
            for shard_path, names in listings(self.client, group):   # missing: cleaned already
                entries += [join(shard_path, name) for name in names]
                for name in names:
                    payload = self.layout.parse_payload_entry(name)
                    parsed = self.layout.parse_expiry_entry(name)
                    if payload is not None:
                        payloads.append(payload)
                    elif parsed is not None:
                        keys.append(Key(*parsed))
            removed += self._expire_nodes(keys, cutoff)
            # After the nodes: a chunked node deleted just now leaves its chunks
            # to its container's entry, which is in this hour too.
            self._expire_payloads(payloads, cutoff)
            self._delete_batched([(entry, -1) for entry in entries])
            self._delete_singly([(shard, -1) for shard in group])
        # Gone already, or written to meanwhile: the next cleanup gets it
        delete_if_there(self.client, bucket, also=(NotEmptyError,))
        return removed

    def _expire_nodes(self, keys: list[Key], cutoff: float) -> int:
        client = self.client
        paths = [self._path_of(key) for key in keys]
        stats = [client.exists_async(path) for path in paths]
        targets = []
        for key, path, async_stat in zip(keys, paths, stats):
            stat = reply_or_retry(client, async_stat, client.exists, path)
            if stat is None or stat.mtime / 1000.0 >= cutoff:
                continue
            if key.kind == CHORD:
                self._delete_key(key)  # with its parts
            else:  # version: a rewrite since the stat wins
                targets.append((path, stat.version))
        return self._delete_batched(targets)

    def _expire_payloads(self, payloads: list[PayloadName], cutoff: float) -> None:
        """Delete the containers of expired entries no live node needs.

        A container is kept while its node points at it and was written after
        the cutoff: that write, in a later hour, made an entry there too. A node
        that points at it and is expired as well goes with it (one multi). Any
        other container is an orphan: its writer died between chunks, or its
        node was replaced, deleted or never written.
        """
        client = self.client
        containers = [self.layout.payload(*payload) for payload in payloads]
        nodes = [self._path_of(Key(p.kind, p.id)) if p.kind in (RESULT, GROUP) else None
                 for p in payloads]
        there = [client.exists_async(container) for container in containers]
        reads = [client.get_async(node) if node else None for node in nodes]
        for payload, container, node, exists, read in zip(payloads, containers, nodes,
                                                          there, reads):
            if reply_or_retry(client, exists, client.exists, container) is None:
                continue   # deleted with its node already
            try:
                data, stat = (reply_or_retry(client, read, client.get, node) if node
                              else (None, None))
            except NoNodeError:
                data, stat = None, None
            manifest = self._manifest_of(data, payload)
            if node is None or stat is None or manifest is None:
                delete_container(client, container)
            elif stat.mtime / 1000.0 < cutoff:
                commit_deleting(client, deleting(node, stat.version),
                                chunk_paths(container, manifest))

    @staticmethod
    def _manifest_of(data: bytes | None, payload: PayloadName) -> Manifest | None:
        """The manifest in ``data`` if it points at ``payload``'s container."""
        if not is_manifest(data):
            return None
        try:
            manifest = parse_manifest(data or b"")
        except PayloadError:
            return None
        return manifest if manifest.ref == payload.token else None

    def _delete_batched(self, targets: list[tuple[str, int]]) -> int:
        """Delete ``(path, version)`` pairs in multis of :data:`BATCH`, pipelined.

        One multi is one request and one log write for the server, instead of
        a request per node. A multi fails whole when one node was deleted or
        rewritten meanwhile; that batch is then redone one delete at a time.
        Returns how many nodes were deleted.
        """
        client = self.client
        pending = []
        for start in range(0, len(targets), BATCH):
            batch = targets[start:start + BATCH]
            txn = client.transaction()
            for path, version in batch:
                txn.delete(path, version=version)
            pending.append((batch, txn.commit_async()))
        removed = 0
        for batch, result in pending:
            try:
                failed = multi_failure(result.get()) is not None
            except CONNECTION_ERRORS:  # committed or not: the redo below tells
                failed = True
            removed += self._delete_singly(batch) if failed else len(batch)
        return removed

    def _delete_singly(self, targets: list[tuple[str, int]]) -> int:
        """Pipelined deletes; nodes gone, rewritten or not empty meanwhile are skipped."""
        client = self.client

        def attempt() -> int:  # repeatable: what is gone already is skipped
            results = [client.delete_async(path, version=version) for path, version in targets]
            deleted = 0
            for result in results:
                try:
                    result.get()
                    deleted += 1
                except (NoNodeError, BadVersionError, NotEmptyError):
                    pass
            return deleted

        return int(client.retry(attempt))
