"""Writing a done node: created or replaced together with its expiry index
entry in one multi, a stored SUCCESS never replaced, shard directories made
when first needed, a value above ``chunk_size`` written as chunks first (see
:mod:`celery_zk.backend.payloads`) (a mixin of
:class:`~celery_zk.backend.ZooKeeperBackend`)."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from celery import states
from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError
from kazoo.retry import ForceRetryError

from ..exceptions import ResultTooLarge
from ..zk.client import FAILOVER_PATIENCE, connected_retry, multi_failure, unwaited
from ..zk.layout import Layout
from ..zk.payload import commit_deleting, needs_chunks
from .expiry import CHORD, Key, expiry_hour
from .payloads import ResultPayloads, Stored

__all__ = ["WRITE_ATTEMPTS", "ResultWrites"]

logger = logging.getLogger(__name__)

WRITE_ATTEMPTS = 10


class ResultWrites:
    """The write path of the result backend."""

    layout: Layout
    max_size: int                # max_result_size
    chunk_size: int
    payloads: ResultPayloads
    clock: Callable[[], float]   # seconds since the epoch (tests move it)

    if TYPE_CHECKING:   # provided by the backend class
        @property
        def client(self) -> KazooClient: ...

        def path(self, key: Key) -> str: ...

        def decode(self, payload: Any) -> Any: ...

        def encode(self, data: Any) -> Any: ...

    def encoded(self, data: Any) -> bytes:
        """``data`` serialized as a node's bytes (Celery's ``encode`` may give a str)."""
        return as_bytes(self.encode(data))

    def check_size(self, task_id: str, data: bytes | str, what: str = "task") -> None:
        size = len(data)
        if size > self.max_size:
            raise ResultTooLarge(
                f"Result of {what} {task_id} is {size:,} bytes, above the limit of "
                f"{self.max_size:,} (option max_result_size). Every stored byte is held "
                "in the memory of every ZooKeeper server: store large results elsewhere "
                "(object storage, a database) and return a reference, or raise "
                "max_result_size (see docs/sizing.md).")

    def _write(self, key: Key, value: bytes | str, keep_success: bool = False,
               create_only: bool = False, fresh: bool = False) -> bool:
        """Create or replace a node and index it for expiry, atomically.

        With ``keep_success`` a stored SUCCESS is never replaced (the same rule
        as Celery's ``_store_result``, here a compare-and-set on the node
        version instead of a racy read-then-write); with ``create_only`` an
        existing node is left alone. False when the node was left alone.
        ``fresh`` guesses the node is new and tries one multi before reading.
        """
        data = as_bytes(value)
        if key.kind == CHORD or not needs_chunks(data, self.chunk_size):
            return self._retry(self._inner_write, key, data, keep_success, create_only,
                               fresh, None)
        # The chunks first, then the node (with the manifest) that makes them
        # visible. If the write fails after the chunks, whether the node points
        # at them is unknown: they are left to cleanup(), which finds them by
        # their index entry and deletes them unless a node points at them.
        stored = self.payloads.store(key, data, expiry_hour(self.clock()))
        written = bool(self._retry(self._inner_write, key, stored.manifest, keep_success,
                                   create_only, fresh, stored))
        if not written:   # the node was left alone: nothing points at the chunks
            self.payloads.discard(stored)
        return written

    def _retry(self, func: Callable[..., Any], *args: Any) -> Any:
        # Rides out a leader failover (a task's result lost to one would turn a
        # success into a FAILURE that nobody retries), then fails during a longer
        # outage (Celery's result_backend_always_retry takes over) instead of
        # waiting it out.
        return connected_retry(self.client, func, *args, patience=FAILOVER_PATIENCE)

    def _inner_write(self, key: Key, data: bytes, keep_success: bool,
                     create_only: bool, fresh: bool, stored: Stored | None) -> bool:
        if fresh and self._create_once(key, data, stored):
            return True
        for _ in range(WRITE_ATTEMPTS):
            written = self._write_once(key, data, keep_success, create_only, stored)
            if written is not None:
                return written
        raise ForceRetryError()  # sustained contention: let KazooRetry back off

    def _create_once(self, key: Key, data: bytes, stored: Stored | None) -> bool:
        """Node and index entry in one multi, if both are new (one round trip).

        Their shard directories nearly always exist already, so they are made
        only when the multi says one is missing. False when the node exists:
        a rewrite reads first.
        """
        path = self.path(key)
        hour = expiry_hour(self.clock())
        entry = self.layout.expiry_entry(hour, key.kind, key.id)
        for _ in range(2):
            tx = self.client.transaction()
            tx.create(path, data)
            tx.create(entry)
            if stored is not None:
                self.payloads.visible_ops(tx, key, stored, hour)
            failure = multi_failure(tx.commit())
            if failure is None:
                return True
            if not isinstance(failure[1], NoNodeError):
                return False
            self._check_container(key, stored)
            self._make_directories(key, hour)
        return False

    def _check_container(self, key: Key, stored: Stored | None) -> None:
        """A multi failed with NoNode: a missing directory, or the chunks'
        container collected meanwhile, after which the write cannot succeed."""
        if stored is not None and self.client.exists(stored.container) is None:
            raise self.payloads.missing_container(key, stored)

    def _make_directories(self, key: Key, hour: int) -> None:
        """The directories ``key``'s node and index entry go in."""
        self.make_parents([self.path(key), self.layout.expiry_entry(hour, key.kind, key.id)])

    def make_parents(self, paths: Iterable[str]) -> None:
        """Create the directories ``paths`` go in (idempotent).

        A missing shard directory usually means its whole level is new: the
        first write under this root, or the first of an hour in the expiry
        index. The writer whose create of the level succeeds makes all its 256
        shards, in the background, so later writes find them in place. Everyone
        else makes only the shard it needs: every pool thread (and process) of
        a freshly started worker meets the missing level at once, and each
        making all of them stalled the first burst of tasks for seconds.
        """
        layout, client = self.layout, self.client
        needed = {layout.parent(path) for path in paths}
        sharded = {layout.results, layout.groups, layout.payloads}
        for _ in range(2):
            # One session's requests are applied in order: each level before its
            # shard, in one round trip.
            levels = {level: client.create_async(level)
                      for level in {layout.parent(d) for d in needed}}
            shards = [client.create_async(d) for d in needed]
            missing = []
            for level, made in levels.items():
                try:
                    made.get()
                except NodeExistsError:
                    continue
                except NoNodeError:
                    missing.append(level)
                    continue
                if level in sharded or layout.parent(level) == layout.expiry:
                    self._fill_level(level)
            for result in shards:
                try:
                    result.get()
                except (NodeExistsError, NoNodeError):
                    pass   # a missing level is in ``missing``
            if not missing:
                return
            for level in missing:   # a new root: its top directories first
                client.ensure_path(layout.parent(level))

    def _fill_level(self, level: str) -> None:
        """Make every shard of a level this process created, without waiting."""
        # One not made here is made by the first write needing it.
        for shard in self.layout.shards(level):
            unwaited(self.client.create_async(shard), logger, "celery_zk: could not make %s",
                     level, expected=(NodeExistsError,))

    def _write_once(self, key: Key, data: bytes, keep_success: bool,
                    create_only: bool, stored: Stored | None) -> bool | None:
        """One read + one multi (two round trips); None on a conflict."""
        client = self.client
        path = self.path(key)
        hour = expiry_hour(self.clock())
        entry = self.layout.expiry_entry(hour, key.kind, key.id)
        current = client.get_async(path)
        indexed = client.exists_async(entry)
        try:
            old, stat = current.get()
        except NoNodeError:
            old, stat = None, None
        if stat is not None and stored is not None and old == data:
            return True   # our own multi, whose reply was lost (the manifest is new)
        if stat is not None and (create_only or keep_success and self._is_success(key, old)):
            return False
        needs_entry = indexed.get() is None

        def change(tx: Any) -> None:
            # Without the transaction, a crash between the two would leave a
            # result cleanup() never finds, or an index entry for nothing.
            if stat is None:
                tx.create(path, data)
            else:
                tx.set_data(path, data, version=stat.version)
            if needs_entry:
                tx.create(entry)
            if stored is not None:
                self.payloads.visible_ops(tx, key, stored, hour)

        # An old chunked value goes in the same multi (see celery_zk.backend.payloads).
        failure = commit_deleting(self.client, change, self.payloads.chunks_of(key, old))
        if failure is None:
            return True
        if isinstance(failure[1], NoNodeError):
            self._check_container(key, stored)
            self._make_directories(key, hour)  # a new shard or hour
            return None
        if isinstance(failure[1], (BadVersionError, NodeExistsError)):
            return None  # a concurrent writer: read again
        raise failure[1]

    def _is_success(self, key: Key, data: bytes) -> bool:
        try:
            # A chunked result is read whole: rare (a rewrite of a big result).
            value = self.payloads.resolve([key], [data])[0]
            return bool(self.decode(value)["status"] == states.SUCCESS)
        except Exception:  # chunks gone, or an undecodable node: not a result to protect
            return False


def as_bytes(data: bytes | str) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)
