"""Waiting for results on ZooKeeper watches instead of polling.

Each waited-for done node is read and watched in one round trip (``exists``
with a watch, pipelined with a ``get``), so a result is either seen by that
read or fires the watch. Watch callbacks run on kazoo's event thread and must
never block: they queue the task id and *start* the next read and watch.
:meth:`drain_events`, on the waiting thread, collects those reads and reads
the chunks of a chunked result (16 MiB is 128 requests, which a callback
must not start). After a reconnect every pending task is read and watched
again. See ``docs/backend.md``, "Waiting without polling".
"""
from __future__ import annotations

import logging
import os
import queue
from collections.abc import Callable, Sequence
from typing import Any

from celery import states
from celery.backends.asynchronous import BaseResultConsumer
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import WatchedEvent
from kombu.utils.functional import LRUCache

from ..zk.client import CONNECTION_ERRORS, connected_retry
from ..zk.session import weak_callback

__all__ = ["ResultConsumer", "read_nodes"]

logger = logging.getLogger(__name__)

Watch = Callable[[WatchedEvent], None]

DELIVERED_MAX = 1000

#: Queued by the state listener: re-read every pending task.
_RECONNECTED = None
#: Queued by consume_from (once per batch): new ids wait in ``_unread``.
_NEW = ""


def read_nodes(client: KazooClient, paths: Sequence[str],
               watch: Watch | None = None) -> list[bytes | None]:
    """The data of each node (``None`` where missing), in one round trip.

    With ``watch``, each node is also watched for its creation or its next
    change; the ``exists`` is sent before the ``get`` on the same session, so
    ZooKeeper orders them and no write can fall between read and watch.
    """
    return connected_retry(client, _read_nodes, client, list(paths), watch)


def _read_nodes(client: KazooClient, paths: list[str],
                watch: Watch | None) -> list[bytes | None]:
    pending = [read_async(client, path, watch) for path in paths]
    return [collect(async_result) for async_result in pending]


def read_async(client: KazooClient, path: str, watch: Watch | None = None) -> Any:
    """Start reading ``path`` (with ``watch``: watch it first); never blocks."""
    if watch is not None:
        client.exists_async(path, watch=watch)
    return client.get_async(path)


def collect(async_result: Any) -> bytes | None:
    """The data of a read started by :func:`read_async`; ``None`` if the node is missing."""
    try:
        data, _ = async_result.get()
    except NoNodeError:
        return None
    return data


class ResultConsumer(BaseResultConsumer):
    """Celery's result consumer interface on top of ZooKeeper data watches."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Weak: kazoo holds both, and must not keep a dropped backend alive.
        self._watch_cb = weak_callback(self._on_watch)
        self.backend._handle.add_listener(weak_callback(self._on_state))
        self._reset()

    def _reset(self) -> None:
        # Plain dict/queue operations only (atomic under the GIL): cancel_for()
        # runs from AsyncResult.__del__, where taking a lock could deadlock.
        self._pending: dict[str, str] = {}   # task id -> done node path
        self._by_path: dict[str, str] = {}   # done node path -> task id
        self._woken: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        # Ids to read (and watch) for the first time. A set, not the queue: a
        # chord part restores its whole group, which asks for every header
        # result and drops them again, without ever draining; queued, those
        # ids piled up by the million and the chord's final join read them all.
        self._unread: set[str] = set()
        self._new_signalled = False
        self._early: dict[str, Any] = {}   # task id -> read a watch callback started
        self._client: KazooClient | None = None
        self._disconnected = False
        self._pid = os.getpid()
        #: Ids recently handed over as ready, for ZooKeeperBackend.is_cached().
        self.delivered: LRUCache = LRUCache(limit=DELIVERED_MAX)

    # -- kazoo threads: never block -------------------------------------------
    def _on_watch(self, event: WatchedEvent) -> None:
        if event.path is None:
            return  # connection-state event: _on_state re-arms everything
        task_id = self._by_path.get(event.path)
        if task_id is None:
            return
        client = self._client
        if client is not None and client.connected:
            try:
                # Read (and watch again) now: kazoo only queues the requests.
                self._early[task_id] = read_async(client, event.path, self._watch_cb)
            except CONNECTION_ERRORS:
                pass   # closing meanwhile: the waiting thread reads, and reports, itself
        self._woken.put(task_id)

    def _on_state(self, state: str) -> None:
        if state == KazooState.CONNECTED:
            if self._disconnected:
                self._disconnected = False
                self._woken.put(_RECONNECTED)
        else:
            self._disconnected = True

    # -- Celery's interface ---------------------------------------------------
    def start(self, initial_task_id: str, **kwargs: Any) -> None:
        self.consume_from(initial_task_id)

    def on_wait_for_pending(self, result: Any, timeout: float | None = None,
                            **kwargs: Any) -> None:
        # Connect before celery's drain loop: that loop treats any OSError (our
        # ZKConnectionError is one) as a passing hiccup and would retry forever.
        self._ensure_client()

    def consume_from(self, task_id: str) -> None:
        self._check_fork()
        if task_id in self._pending:
            return
        path = self.backend.result_path(task_id)
        self._by_path[path] = task_id
        self._pending[task_id] = path
        # The first read happens in drain_events, in the waiting thread; it
        # both returns a result already written and arms the watch.
        self._unread.add(task_id)
        if not self._new_signalled:   # one wake-up per batch (see _take_unread)
            self._new_signalled = True
            self._woken.put(_NEW)

    def cancel_for(self, task_id: str) -> None:
        path = self._pending.pop(task_id, None)
        if path is not None:
            self._by_path.pop(path, None)
        self._early.pop(task_id, None)
        self._unread.discard(task_id)
        # A watch already set stays until it fires; it is then ignored.

    def _take_unread(self) -> set[str]:
        """Every id consume_from added. The flag is reset first: an id added after
        the pops below finds it reset and queues a new wake-up."""
        self._new_signalled = False
        taken = set()
        while True:
            try:
                taken.add(self._unread.pop())
            except KeyError:
                return taken

    def drain_events(self, timeout: float | None = None) -> None:
        client = self._ensure_client()
        try:
            first = self._woken.get(timeout=timeout)
        except queue.Empty:
            return
        woken = {first}
        while True:
            try:
                woken.add(self._woken.get_nowait())
            except queue.Empty:
                break
        woken |= self._take_unread()
        if _RECONNECTED in woken:
            task_ids = list(self._pending.copy())
        else:
            task_ids = [t for t in woken if t and t in self._pending]
        early = {t: self._early.pop(t, None) for t in woken if t}
        read: list[tuple[str, bytes | None]] = []
        unread = []
        for task_id in task_ids:
            started = early.get(task_id)
            if started is not None:
                try:
                    read.append((task_id, collect(started)))
                    continue
                except CONNECTION_ERRORS:
                    pass   # lost with the connection: read again below, with retries
            unread.append(task_id)
        if unread:
            paths = [self.backend.result_path(task_id) for task_id in unread]
            read.extend(zip(unread, read_nodes(client, paths, self._watch_cb)))
        # A chunked result's chunks are read here, in the waiting thread: never
        # from a watch callback (see the module docstring).
        datas = self.backend.read_results([task_id for task_id, _ in read],
                                          [data for _, data in read])
        for data in datas:
            if data:
                self.on_state_change(self.backend.decode_result(data), None)

    def on_state_change(self, meta: dict[str, Any], message: Any) -> None:
        super().on_state_change(meta, message)
        if meta["status"] in states.READY_STATES:
            self.delivered[meta["task_id"]] = True
            self.cancel_for(meta["task_id"])

    def on_after_fork(self) -> None:
        # The parent's watches, listener and queue belong to its client; the
        # child gets its own client from ClientHandle and starts empty.
        self._reset()

    def stop(self) -> None:
        self._client = None

    # -- internals ------------------------------------------------------------
    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            self._after_fork()

    def _ensure_client(self) -> KazooClient:
        self._check_fork()
        client = self.backend.client
        if client is not self._client:
            if self._client is not None:  # a new session: no watch of ours on it
                self._woken.put(_RECONNECTED)
            self._client = client
        return client
