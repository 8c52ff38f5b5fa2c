"""Publishing without waiting for ZooKeeper's reply (``confirm_publish=False``),
as AMQP's basic.publish without publisher confirms.

A publish only sends its create; the session's requests stay in order, so
messages land in publish order. Every exit path must wait for the replies
(the transport's close, a multiprocessing finalizer for pooled connections,
``worker_process_shutdown`` in a prefork child); a reply lost to a dropped
connection is redone by a background thread that first looks for the node by
its uid, so nothing is published twice. A message in flight when the process
is killed is lost. See ``docs/configuration.md``, "Unconfirmed publishing
(`confirm_publish=false`)".
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from multiprocessing.util import Finalize
from typing import Any

from celery.signals import worker_process_shutdown

from ..zk.client import CONNECTION_ERRORS, RedoThread, multi_failure
from .publish import NewMessage, Publisher

logger = logging.getLogger(__name__)

#: Most unconfirmed publishes in flight per connection; the next publish waits
#: for a reply (back-pressure, and a bound on what a crash can lose).
WINDOW = 256

_publishers: weakref.WeakSet[UnconfirmedPublisher] = weakref.WeakSet()


class UnconfirmedPublisher:
    """Pipelined publishes through one :class:`~celery_zk.broker.publish.Publisher`."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._in_flight = 0
        self._redo = self._redo_thread()
        _publishers.add(self)
        _hook_exit()

    def put(self, message: NewMessage) -> None:
        with self._cond:
            if self._pid != os.getpid():  # forked: the parent's replies never come here
                self._pid, self._in_flight, self._redo = os.getpid(), 0, self._redo_thread()
                _hook_exit()
            while self._in_flight >= WINDOW:
                self._cond.wait()
            self._in_flight += 1
        try:
            txn = self.publisher.client.transaction()
            message.add_to(txn, self.publisher.layout)
            result = txn.commit_async()
        except BaseException:
            self._finished()
            raise
        result.rawlink(lambda done: self._on_reply(done, message))

    def _redo_thread(self) -> RedoThread[tuple[NewMessage, bool]]:
        return RedoThread("celery_zk-publish-redo", self._redo_one)

    def _on_reply(self, result: Any, message: NewMessage) -> None:
        # kazoo's event thread: never block here; anything but success goes to the thread.
        try:
            results = result.get()
        except Exception:
            self._redo.submit((message, True))   # no reply: it may have been stored
            return
        if multi_failure(results) is not None:
            # Refused (e.g. its bucket filled or went meanwhile): a multi is all
            # or nothing, so it is not stored; redone, named for the queue's tail.
            self._redo.submit((message, False))
            return
        self.publisher.created(message, results[-1].rpartition("/")[2])
        self._finished()

    def _redo_one(self, item: tuple[NewMessage, bool]) -> None:
        message, maybe_made = item
        try:
            # A lost reply may hide a create that happened: look before making another.
            self.publisher.put_new(message, maybe_made=maybe_made)
        except Exception as exc:
            logger.error("celery_zk: an unconfirmed publish to queue %r failed and the "
                         "message is LOST (confirm_publish=False): %s: %s",
                         message.queue, type(exc).__name__, exc,
                         exc_info=not isinstance(exc, CONNECTION_ERRORS))
        finally:
            self._finished()

    def _finished(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every publish so far is stored. False if ``timeout`` ran out."""
        with self._cond:
            if self._pid != os.getpid():
                return True
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout)

    @property
    def in_flight(self) -> int:
        return self._in_flight


def flush_all(timeout: float = 30) -> None:
    """Wait until every unconfirmed publish of this process is stored (or ``timeout``).

    Pooled connections are often never closed (Celery's ``app.close()`` leaves
    kombu's producer pool open): this runs at exit, and a script may call it.
    """
    for publisher in list(_publishers):
        if not publisher.flush(timeout=timeout):
            logger.error("celery_zk: %d unconfirmed publish(es) still in flight at exit",
                         publisher.in_flight)


_hooked_pid = 0


def _hook_exit() -> None:
    """Flush at this process's exit, once per process.

    A multiprocessing finalizer: in the main process it runs from ``atexit``;
    billiard clears the parent's finalizers in a new child, so each process
    registers its own. A prefork pool child, though, leaves through
    ``os._exit`` without running either: :func:`_flush_in_pool_child` covers it.
    """
    global _hooked_pid
    if _hooked_pid != os.getpid():
        _hooked_pid = os.getpid()
        Finalize(None, flush_all, exitpriority=100)


@worker_process_shutdown.connect(weak=False)
def _flush_in_pool_child(**_: Any) -> None:
    """Celery sends this in a pool child just before billiard's ``os._exit``
    (after ``--max-tasks-per-child`` tasks, at a pool shrink or a shutdown)."""
    flush_all()
