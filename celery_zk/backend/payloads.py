"""Results bigger than ``chunk_size``: where their chunks live, and their lifecycle.

A result meta (or saved group) is stored with :mod:`celery_zk.zk.payload` in
a container of its own per write, ``payloads/{shard}/{kind}~{id}~{token}~{size}``,
and its done node holds the manifest (whose ``ref`` is the token). The
container's index entry is written before its chunks, and the done node only
after them; the multi that replaces or deletes a done node deletes the old
chunks too, and a reader that finds a chunk missing reads the done node again
(:meth:`resolve`). See ``docs/backend.md``, "Large results: chunks".
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import NodeExistsError, NoNodeError
from kazoo.retry import ForceRetryError

from ..exceptions import ChunkMissing, PayloadError
from ..zk.client import connected_retry, log_failure, multi_failure
from ..zk.layout import Layout
from ..zk.payload import (
    chunk_paths,
    delete_container,
    is_manifest,
    parse_manifest,
    read_payloads,
    write_chunks,
)
from .expiry import Key

__all__ = ["ResultPayloads", "Stored"]

logger = logging.getLogger(__name__)

#: Times a read starts over when a chunk vanished under it (its result was
#: replaced or deleted meanwhile) before it reports the payload as broken.
READ_ATTEMPTS = 5


class Stored(NamedTuple):
    """Chunks written, not yet made visible."""

    manifest: bytes   # what the done node gets
    container: str
    token: str
    size: int
    hour: int         # of the container's first index entry


class ResultPayloads:
    """The backend's chunked payloads (see the module docstring)."""

    def __init__(self, client: Callable[[], KazooClient], layout: Layout, chunk_size: int,
                 path_of: Callable[[Key], str],
                 make_parents: Callable[[Iterable[str]], None]) -> None:
        self._client = client   # a callable: the backend's client is made per process
        self.layout = layout
        self.chunk_size = chunk_size
        self._path_of = path_of
        self._make_parents = make_parents

    @property
    def client(self) -> KazooClient:
        return self._client()

    # -- where -----------------------------------------------------------------
    def container(self, key: Key, manifest: bytes) -> str:
        """The container a done node's manifest points at."""
        parsed = parse_manifest(manifest, self._path_of(key))
        return self.layout.payload(key.kind, key.id, parsed.ref, parsed.size)

    def entry(self, key: Key, stored: Stored, hour: int) -> str:
        return self.layout.payload_entry(hour, key.kind, key.id, stored.token, stored.size)

    def chunks_of(self, key: Key, data: bytes | None) -> list[str]:
        """The nodes to delete with a done node holding ``data``: none unless it is
        a manifest."""
        if data is None or not is_manifest(data):
            return []
        try:
            return chunk_paths(self.container(key, data), parse_manifest(data))
        except PayloadError as exc:   # not ours to read: its chunks, if any, expire
            logger.warning("celery_zk: %s", exc)
            return []

    # -- writing ---------------------------------------------------------------
    def store(self, key: Key, data: bytes, hour: int) -> Stored:
        """Make a container (indexed in ``hour``) and write ``data`` into it."""
        token = uuid.uuid4().hex[:16]
        container = self.layout.payload(key.kind, key.id, token, len(data))
        stored = Stored(b"", container, token, len(data), hour)
        connected_retry(self.client, self._make_container, container,
                        self.entry(key, stored, hour))
        manifest = write_chunks(self.client, container, data, self.chunk_size, ref=token)
        return stored._replace(manifest=manifest)

    def _make_container(self, container: str, entry: str) -> None:
        for _ in range(2):
            tx = self.client.transaction()
            tx.create(container)
            # Without the transaction, a container made just before a crash
            # would have no index entry, and nothing would ever collect it.
            tx.create(entry)
            failure = multi_failure(tx.commit())
            if failure is None or isinstance(failure[1], NodeExistsError):
                return   # the token is new: only our own lost reply made them (both)
            if not isinstance(failure[1], NoNodeError):
                raise failure[1]
            self._make_parents([container, entry])
        raise ForceRetryError()

    def visible_ops(self, tx: TransactionRequest, key: Key, stored: Stored, hour: int) -> None:
        """What the multi making ``stored`` visible adds: an index entry for this
        hour if the container's is from an earlier one, and a check that the
        container is still there (not collected as an orphan meanwhile)."""
        if hour != stored.hour:
            tx.create(self.entry(key, stored, hour))
        tx.check(stored.container, -1)

    def missing_container(self, key: Key, stored: Stored) -> PayloadError:
        return PayloadError(
            f"The chunks of {key.id} ({stored.container}) were deleted before its node "
            "was written: cleanup() collected them as an orphan, so writing took longer "
            "than result_expires. Nothing was stored; store the result again.")

    def discard(self, stored: Stored) -> None:
        """Delete chunks nothing points at (a write that was left alone)."""
        try:
            delete_container(self.client, stored.container)
        except Exception as exc:   # its index entry has cleanup() collect it later
            log_failure(logger, exc, "celery_zk: could not delete unused chunks %s",
                        stored.container)

    # -- reading ---------------------------------------------------------------
    def resolve(self, keys: Sequence[Key], datas: Sequence[bytes | None],
                broken: Callable[[Key, PayloadError], bytes] | None = None
                ) -> list[bytes | None]:
        """The full value of each node as read: a manifest's chunks read and checked
        (all of them pipelined); anything else as it is.

        A payload that cannot be read raises :class:`PayloadError`, or, with
        ``broken``, is replaced by what ``broken`` makes of its error, so one
        broken result does not keep the others of a batch from their waiters.
        """
        try:
            return self._resolve(keys, datas)
        except PayloadError:
            if broken is None:
                raise
        out: list[bytes | None] = []
        for key, data in zip(keys, datas):   # each alone, to tell which is broken
            try:
                out.extend(self._resolve([key], [data]))
            except PayloadError as exc:
                out.append(broken(key, exc))
        return out

    def _resolve(self, keys: Sequence[Key], datas: Sequence[bytes | None]
                 ) -> list[bytes | None]:
        out = list(datas)
        for _ in range(READ_ATTEMPTS):
            todo = [i for i, data in enumerate(out) if is_manifest(data)]
            if not todo:
                return out
            items = [(self.container(keys[i], out[i] or b""), out[i] or b"") for i in todo]
            try:
                values = read_payloads(self.client, items)
            except ChunkMissing as missing:
                container = self.layout.parent(missing.path)
                index = next(i for i, (c, _) in zip(todo, items) if c == container)
                now = self._read_again(keys[index])
                if now == out[index]:
                    raise PayloadError(
                        f"The result of {keys[index].id} cannot be read: {missing} Its "
                        "node still points at it. Delete the result (forget()) and run "
                        "the task again.") from None
                out[index] = now   # replaced or deleted meanwhile: what is there now
                continue
            for i, value in zip(todo, values):
                out[i] = value
            return out
        raise PayloadError(
            f"Results {', '.join(keys[i].id for i in todo)} changed {READ_ATTEMPTS} times "
            "while being read; read them again.")

    def _read_again(self, key: Key) -> bytes | None:
        client = self.client
        try:
            data, _ = connected_retry(client, client.get, self._path_of(key))
        except NoNodeError:
            return None
        return bytes(data)
