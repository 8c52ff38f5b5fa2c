"""Apache ZooKeeper result backend for Celery.

Features
========
* Each task's result meta lives in one *done node*, ``results/{shard}/{task
  id}``, found from the task id alone (256 shards: a million results is about
  4,000 nodes per directory).
* ``AsyncResult.get()``, ``GroupResult.get()/join()`` and ``ResultSet`` wait on
  ZooKeeper watches, not by polling (see :mod:`celery_zk.backend.result_consumer`).
* Groups are saved under ``groups/``; chords count their finished header tasks
  with a native counter (:mod:`celery_zk.backend.chord`), so Celery never runs the
  polling ``chord_unlock`` task.
* ``result_expires`` is honoured by :meth:`ZooKeeperBackend.cleanup` through
  an index of nodes by the hour they were written: cleanup reads only expired
  hours, never the done area. Workers run it by themselves, one at a time per
  root (:mod:`celery_zk.backend.autoexpire`); beat's ``backend_cleanup`` may
  call it too.
* A result larger than ``chunk_size`` is stored as chunks written before its
  done node, which then holds a small manifest
  (:mod:`celery_zk.backend.payloads`); every read returns the whole value. One
  larger than ``max_result_size`` fails its task with :class:`ResultTooLarge`
  (a :class:`~celery_zk.exceptions.MessageTooLarge`).

The URL and ``result_backend_transport_options`` are the broker's
(:class:`celery_zk.zk.config.ZKOptions`); ``docs/backend.md`` names the
options the backend uses, ``docs/configuration.md`` their defaults.
"""
from __future__ import annotations

import logging
import queue
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from celery import states
from celery.backends.asynchronous import AsyncBackendMixin
from celery.backends.base import BaseKeyValueStoreBackend
from celery.exceptions import TimeoutError
from celery.result import result_from_tuple
from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoNodeError
from kazoo.protocol.states import WatchedEvent
from kazoo.retry import ForceRetryError

from ..compat.celery import is_lazy, is_stray_copy
from ..zk.client import CONNECTION_ERRORS
from ..zk.config import mask_in_celery_reports, mask_password, parse_url
from ..zk.layout import Layout
from ..zk.payload import commit_deleting, deleting, needs_chunks
from ..zk.session import ClientHandle
from ..zk.tree import delete_tree
from .chord import ChordCounter
from .chord_body import PartResult, send_chord_body
from .expiry import CHORD, GROUP, RESULT, ExpiryIndex, Key
from .payloads import ResultPayloads
from .result_consumer import ResultConsumer, read_nodes
from .writes import ResultWrites, as_bytes

__all__ = ["ZooKeeperBackend"]

logger = logging.getLogger(__name__)


mask_in_celery_reports()   # app.conf.humanize() shows result_backend too


class ZooKeeperBackend(ResultWrites, BaseKeyValueStoreBackend, AsyncBackendMixin):
    """Task results in ZooKeeper; waits on watches (see module docstring)."""

    ResultConsumer = ResultConsumer

    supports_native_join = True
    supports_autoexpire = True  # workers clean (autoexpire), beat need not
    supports_result_compression = True  # node data is stored as raw bytes
    implements_incr = True

    #: Exceptions after which a result operation may be retried
    #: (with ``result_backend_always_retry``): the transport's list, since a
    #: closed or timed-out client is replaced by a new one on the next call.
    connection_errors = CONNECTION_ERRORS

    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
        super().__init__(url=url, **kwargs)
        conf = self.app.conf
        if not url:
            configured = conf.result_backend
            url = configured if isinstance(configured, str) and "://" in configured else "zk://"
        self.url = url
        self.settings = parse_url(url, conf.get("result_backend_transport_options"))
        self.layout = Layout(self.settings.root)
        self.max_size = self.settings.options.max_result_size
        self.chunk_size = self.settings.options.chunk_size
        #: Seconds since the epoch; the expiry index and cleanup() read it.
        self.clock: Callable[[], float] = time.time
        self._handle = ClientHandle(self.settings)
        self.payloads = ResultPayloads(lambda: self.client, self.layout, self.chunk_size,
                                       self.path, self.make_parents)
        self._expiry = ExpiryIndex(lambda: self.client, self.layout, self.path,
                                   self._delete_key)
        self.result_consumer = self.ResultConsumer(
            self, self.app, self.accept, self._pending_results, self._pending_messages)

    def __reduce__(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                   ) -> Any:
        return super().__reduce__(args, dict(kwargs or {}, url=self.url,
                                             expires=self.expires))

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.settings.sanitized_url()}>"

    def as_uri(self, include_password: bool = False) -> str:
        return self.url if include_password else mask_password(self.url)

    @property
    def client(self) -> KazooClient:
        return self._handle.client

    def close(self) -> None:
        """Stop waiting and release this backend's share of the process's ZooKeeper
        session (the last share ends it)."""
        self.result_consumer.stop()
        self._handle.close()

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        return isinstance(exc, self.connection_errors)

    # -- keys -----------------------------------------------------------------
    def get_key_for_task(self, task_id: str, key: str = "") -> Key:
        if not task_id:
            raise ValueError(f"task_id must not be empty. Got {task_id} instead.")
        return Key(RESULT, str(task_id) + key)

    def get_key_for_group(self, group_id: str, key: str = "") -> Key:
        if not group_id:
            raise ValueError(f"group_id must not be empty. Got {group_id} instead.")
        return Key(GROUP, str(group_id) + key)

    def get_key_for_chord(self, group_id: str, key: str = "") -> Key:
        if not group_id:
            raise ValueError(f"group_id must not be empty. Got {group_id} instead.")
        return Key(CHORD, str(group_id) + key)

    def path(self, key: Key) -> str:
        if key.kind == RESULT:
            return self.layout.result(key.id)
        if key.kind == GROUP:
            return self.layout.group(key.id)
        if key.kind == CHORD:
            return self.layout.chord(key.id)
        raise ValueError(f"unknown key kind {key.kind!r}")

    def result_path(self, task_id: str) -> str:
        return self.layout.result(str(task_id))

    # -- key/value primitives -------------------------------------------------
    def get(self, key: Key) -> bytes | None:
        return self.mget([key])[0]

    def mget(self, keys: Iterable[Key]) -> list[bytes | None]:
        keys = list(keys)
        return self.payloads.resolve(keys, read_nodes(self.client, [self.path(k) for k in keys]))

    def set(self, key: Key, value: bytes) -> None:
        # Too large a request makes the server drop the connection: check first.
        self.check_size(key.id, value, what="group" if key.kind == GROUP else "task")
        self._write(key, value, keep_success=False)

    def delete(self, key: Key) -> None:
        if key.kind == CHORD:
            # Celery deletes a chord's counter once the body is sent; it is kept
            # as a tombstone until expiry instead (see celery_zk.backend.chord).
            self._counter(key.id).finish()
            return
        self._delete_key(key)

    def _delete_key(self, key: Key) -> None:
        if key.kind == CHORD:
            # A chord counter and its parts: one multi.
            self._retry(delete_tree, self.client, self.path(key))
        else:
            self._retry(self._delete_value, key)

    def _delete_value(self, key: Key) -> None:
        """Delete a done node or saved group, with its chunks if it has any (one
        multi; see celery_zk.backend.payloads)."""
        path = self.path(key)
        try:
            data, stat = self.client.get(path)
        except NoNodeError:
            return

        failure = commit_deleting(self.client, deleting(path, stat.version),
                                  self.payloads.chunks_of(key, data))
        if failure is None or isinstance(failure[1], NoNodeError):
            return
        if isinstance(failure[1], BadVersionError):
            raise ForceRetryError()   # rewritten meanwhile: read it again
        raise failure[1]

    def expire(self, key: Key, value: Any) -> None:
        """Per-key lifetimes are not kept: cleanup() applies ``result_expires``."""

    def _counter(self, group_id: str) -> ChordCounter:
        key = self.get_key_for_chord(group_id)
        return ChordCounter(self.client, self.layout, key.id,
                            create=lambda: self._write(key, b"0", create_only=True))

    def set_chord_size(self, group_id: str, chord_size: int) -> None:
        """Celery says how many parts chord ``group_id`` waits for (nested groups
        included), before it sends the header's last task."""
        ChordCounter(self.client, self.layout, str(group_id)).set_size(int(chord_size))

    def add_to_chord(self, group_id: str, result: Any) -> None:
        """``Task.add_to_chord``: the chord waits for one more part, ``result``,
        and its body gets that part's result too (the saved header gains it, in
        the same transaction)."""
        group_id = str(group_id)
        group_path = self.path(self.get_key_for_group(group_id))

        def also_in_saved_group(tx: Any) -> None:
            try:
                data, stat = self.client.get(group_path)
            except NoNodeError:
                return   # a lazy header saves no group: its parts name the results
            header = result_from_tuple(self.decode(data)["result"], self.app)
            grown = self.app.GroupResult(group_id, [*header.results, result])
            tx.set_data(group_path, self.encoded({"result": grown.as_tuple()}),
                        version=stat.version)

        self._counter(group_id).add(also_in_saved_group)

    # -- writes ---------------------------------------------------------------
    def mark_as_done(self, task_id: str, result: Any, request: Any = None,
                     store_result: bool = True, state: str = states.SUCCESS) -> None:
        """Celery's, but a chord part's SUCCESS is stored as STARTED and becomes
        SUCCESS in the multi that counts the part (see
        :class:`~celery_zk.backend.chord_body.PartResult`): stopped in between, the
        part runs again even with ``worker_deduplicate_successful_tasks`` (B21)."""
        if not (store_result and state == states.SUCCESS and request is not None
                and getattr(request, "chord", None) and getattr(request, "group", None)
                and not getattr(request, "ignore_result", False)):
            return super().mark_as_done(task_id, result, request, store_result, state)
        part = PartResult(self, str(task_id))
        self.store_result(task_id, result, state, request=request, part=part)
        self.on_chord_part_return(request, state, result, part=part)
        return None

    def _store_result(self, task_id: str, result: Any, state: str,
                      traceback: str | None = None, request: Any = None,
                      part: PartResult | None = None, **kwargs: Any) -> Any:
        meta = self._get_result_meta(result=result, state=state,
                                     traceback=traceback, request=request)
        meta["task_id"] = str(task_id)
        encoded = self.encode(meta)
        self.check_size(task_id, encoded)
        data = as_bytes(encoded)
        if part is not None and not needs_chunks(data, self.chunk_size):
            data = part.hold(meta, data)   # SUCCESS once counted
        # Most tasks are written once: try a blind create first, saving the
        # read. With task_track_started the final state is a rewrite.
        fresh = state == states.STARTED or not self.app.conf.task_track_started
        written = self._write(self.get_key_for_task(task_id), data, keep_success=True,
                              fresh=fresh)
        if part is not None and not written:
            part.success = None   # a SUCCESS stored before stays, and is what counts
        return result

    # -- groups and chords ----------------------------------------------------
    def _apply_chord_incr(self, header_result_args: Any, body: Any, **kwargs: Any) -> Any:
        """Each apply is a run of its own (a frozen chord applied again runs its
        body again). A header given as a generator is neither read nor saved
        here: Celery publishes it as it yields (see celery_zk.backend.chord)."""
        header_id, results = header_result_args[0], header_result_args[1]
        lazy = is_lazy(results)
        if not lazy:
            self._refuse_repeated_ids(header_id, results)
            super()._apply_chord_incr(header_result_args, body, **kwargs)
        # Made up front so it is indexed for expiry even if the chord never ends.
        fresh = self._write(self.get_key_for_chord(header_id), b"0", create_only=True)
        self._counter(header_id).start(lazy=lazy, fresh=fresh)

    @staticmethod
    def _refuse_repeated_ids(header_id: str, results: Any) -> None:
        ids = Counter(getattr(r, "id", r) for r in results or ())
        repeated = sorted(str(task_id) for task_id, n in ids.items() if n > 1)
        if repeated:
            # Celery sends the header after this returns: refusing here sends nothing.
            raise ValueError(
                f"chord {header_id}: header task id(s) {', '.join(repeated)} appear more "
                "than once. celery_zk counts each header task once (so a task that runs "
                "twice is not counted twice), and this chord could never complete. Give "
                "every header task its own id (leave task_id unset, or make the ids "
                "unique). Nothing was sent.")

    def on_chord_part_return(self, request: Any, state: str, result: Any,
                             part: PartResult | None = None, **kwargs: Any) -> Any:
        """Count this header task once; the last part sends the body
        (:mod:`celery_zk.backend.chord_body`). Celery's own protocol restores
        the saved header, every result of it, on each part: O(parts²) for a
        chord, 0.1 s a part at 1,000 parts."""
        gid = request.group
        if not gid:
            return None
        counter = self._counter(str(gid))
        own = part or PartResult(self, str(request.id))
        counted, size, lazy, stalled = counter.increment(
            str(request.id), getattr(request, "group_index", None), also=own.counting)
        if counted is None and stalled and counter.sent():
            logger.warning("celery_zk: chord %s: its body was sent by a worker that "
                           "stopped before it finished the chord; part %s, run again, "
                           "finishes it", gid, request.id)
            counter.finish(also=own.restore)
            self.delete_group(str(gid))
            return None
        if counted is None and stalled:
            logger.warning("celery_zk: chord %s: every part is counted but the body was "
                           "never sent (the worker that counted the last part stopped "
                           "first); part %s, run again, sends it", gid, request.id)
            send_chord_body(self, request, counter, lazy, own)
            return None
        if counted is None:
            logger.warning("celery_zk: chord %s part %s was already counted; ignoring "
                           "the duplicate", gid, request.id)
            self._retry(self._settle, own)
            return None
        if size is None:
            # Celery says the size before it sends the header's last task: this
            # part is not the last (a generator's header still being sent).
            return None
        if counted < size:
            return None
        if counted > size:
            logger.warning("celery_zk: chord %s counted %d parts of %d", gid, counted, size)
            return None
        send_chord_body(self, request, counter, lazy, own)
        return None

    def _settle(self, part: PartResult) -> None:
        """A part counted before: its SUCCESS, if this run stored it as STARTED."""
        if part.success is not None:
            try:
                self.client.set(part.path, part.success)
            except NoNodeError:
                pass

    # -- reading --------------------------------------------------------------
    def is_cached(self, task_id: str) -> bool:
        # Celery's chord error names the failed header task only if it can
        # tell which results it already has; ready results our watches
        # delivered are held by their AsyncResult objects.
        return bool(super().is_cached(task_id) or task_id in self.result_consumer.delivered)

    def remove_pending_result(self, result: Any) -> Any:
        """Celery before 5.7 removes whatever waits on ``result``'s id when any
        object of that id goes (celery#4925): a copy dropped while a group was
        published made the group's get() hang. Only the waiter itself leaves."""
        if is_stray_copy(self._pending_results, result):
            return result
        return super().remove_pending_result(result)

    def forget(self, task_id: str) -> None:
        super().forget(task_id)
        self.result_consumer.cancel_for(task_id)

    def read_results(self, task_ids: Sequence[str], datas: Sequence[bytes | None]
                     ) -> list[bytes | None]:
        """Done nodes' data as read, made whole (a chunked result's chunks read). A
        result that cannot be read becomes a FAILURE whose error says why, for
        its waiter alone: the others of the batch are delivered as usual."""
        return self.payloads.resolve([self.get_key_for_task(t) for t in task_ids], datas,
                                     broken=self._unreadable)

    def _unreadable(self, key: Key, error: Exception) -> bytes:
        meta = self._get_result_meta(result=self.encode_result(error, states.FAILURE),
                                     state=states.FAILURE, traceback=None, request=None)
        meta["task_id"] = key.id
        return self.encoded(meta)

    def get_many(self, task_ids: Iterable[str], timeout: float | None = None,
                 interval: float = 0.5, no_ack: bool = True,
                 on_message: Callable[[dict[str, Any]], None] | None = None,
                 on_interval: Callable[[], None] | None = None,
                 max_iterations: int | None = None,
                 READY_STATES: frozenset[str] = states.READY_STATES,
                 ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yield ``(task id, meta)`` as each result is ready, woken by watches.

        One pipelined read for all ids, then one per woken id; ``interval``
        only paces ``on_interval``, it never triggers a re-read.
        """
        ids = {str(t) for t in task_ids}
        for task_id in list(ids):
            cached = self._cache.get(task_id)
            if cached is not None and cached["status"] in READY_STATES:
                ids.discard(task_id)
                yield task_id, cached
        woken: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        by_path = {self.result_path(t): t for t in ids}

        def on_watch(event: WatchedEvent) -> None:  # kazoo's thread: just queue
            woken.put(by_path.get(event.path) if event.path else None)

        watch = on_watch if max_iterations != 1 else None
        to_read: AbstractSet[str] = frozenset(ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        iterations = 0
        while ids:
            keys = sorted(to_read & ids)
            datas = self.read_results(
                keys, read_nodes(self.client, [self.result_path(t) for t in keys], watch))
            for task_id, data in zip(keys, datas):
                if not data:
                    continue
                meta = self.decode_result(data)
                if meta["status"] not in READY_STATES:
                    continue
                self._cache[task_id] = meta
                ids.discard(task_id)
                if on_message is not None:
                    on_message(meta)
                yield task_id, meta
            iterations += 1
            if not ids or (max_iterations and iterations >= max_iterations):
                break
            to_read = self._wait_woken(woken, ids, deadline, interval, on_interval, timeout)

    def _wait_woken(self, woken: queue.SimpleQueue[str | None], ids: AbstractSet[str],
                    deadline: float | None, interval: float,
                    on_interval: Callable[[], None] | None,
                    timeout: float | None) -> AbstractSet[str]:
        while True:
            wait = interval if deadline is None else min(interval, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"Operation timed out ({timeout})")
            try:
                first = woken.get(timeout=wait)
            except queue.Empty:
                if on_interval:
                    on_interval()
                continue
            got = {first}
            while True:
                try:
                    got.add(woken.get_nowait())
                except queue.Empty:
                    break
            # None: the connection dropped and kazoo cleared our watches.
            return set(ids) if None in got else {t for t in got if t is not None}

    # -- expiry ---------------------------------------------------------------
    def cleanup(self) -> None:
        """Delete results, groups and chords older than ``result_expires``.

        Reads only the expired hours of the expiry index (:mod:`celery_zk.backend.expiry`).
        """
        if not self.expires:
            return
        removed = self._expiry.cleanup(self.clock() - float(self.expires))
        if removed:
            logger.info("celery_zk: cleanup removed %d expired results/groups from %s",
                        removed, self.settings.sanitized_url())

