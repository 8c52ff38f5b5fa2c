"""The expiry index: results, groups and chords by the hour they were written.

Every write of a done node, a saved group or a chord counter also creates an
entry ``expiry/h{hour}/{shard}/{kind}~{id}`` in the same transaction (see
:mod:`celery_zk.backend`), so there is never a node cleanup cannot find.
:meth:`ExpiryIndex.cleanup` lists ``expiry/`` (one name per hour of
retention) and reads only the buckets whose whole hour is past the cutoff:
it never lists the done area, so its cost is proportional to what expired.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoNodeError, NotEmptyError
from kazoo.protocol.paths import join

from .layout import Layout

__all__ = ["CHORD", "GROUP", "HOUR", "RESULT", "ExpiryIndex", "Key", "bucket_expired",
           "expiry_hour"]

RESULT, GROUP, CHORD = "r", "g", "c"  # the kinds of node an index entry points at
HOUR = 3600


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
        try:
            buckets = client.retry(client.get_children, self.layout.expiry)
        except NoNodeError:
            return 0
        removed = 0
        for name in sorted(buckets):
            hour = self.layout.parse_expiry_bucket(name)
            if hour is None or not bucket_expired(hour, cutoff):
                continue
            removed += self._cleanup_bucket(hour, cutoff)
        return removed

    def _cleanup_bucket(self, hour: int, cutoff: float) -> int:
        client = self.client
        bucket = self.layout.expiry_bucket(hour)
        removed = 0
        for shard in client.retry(client.get_children, bucket):
            shard_path = self.layout.expiry_shard(hour, shard)
            names = client.retry(client.get_children, shard_path)
            keys = [Key(*parsed) for parsed in map(self.layout.parse_expiry_entry, names)
                    if parsed is not None]
            removed += client.retry(self._expire_nodes, keys, cutoff)
            for name in names:
                self._delete_quietly(join(shard_path, name))
            self._delete_quietly(shard_path)
        self._delete_quietly(bucket)
        return removed

    def _expire_nodes(self, keys: list[Key], cutoff: float) -> int:
        client = self.client
        paths = [self._path_of(key) for key in keys]
        stats = [client.exists_async(path) for path in paths]
        deletes = []
        for key, path, async_stat in zip(keys, paths, stats):
            stat = async_stat.get()
            if stat is None or stat.mtime / 1000.0 >= cutoff:
                continue
            if key.kind == CHORD:
                self._delete_key(key)  # with its parts
            else:  # version: a rewrite since the stat wins
                deletes.append(client.delete_async(path, version=stat.version))
        removed = 0
        for async_delete in deletes:
            try:
                async_delete.get()
                removed += 1
            except (NoNodeError, BadVersionError):
                pass
        return removed

    def _delete_quietly(self, path: str) -> None:
        client = self.client
        try:
            client.retry(client.delete, path)
        except (NoNodeError, NotEmptyError):
            pass  # gone already, or written to meanwhile: the next cleanup gets it
