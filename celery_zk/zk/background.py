"""The process's one background thread of ours: held-back writes sent when
they are due (:class:`Deferred`), the leases of handles that were
garbage-collected, and, once a worker shuts down, sessions cut off from
ZooKeeper too long (:func:`give_up_when_cut_off`).

It waits on a ``SimpleQueue``, whose ``put`` is reentrant: a finalizer (on
any thread, kazoo's included) and a signal handler may hand it work, but
only through ``put`` (:func:`call_at` takes a lock). Nothing it runs may
block: a round takes a thread of its own. It is started with the process's
first session (and again in a forked child). See ``docs/design.md``, "One
session per process" and "Time constants".
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient, KazooState

from ..compat import kazoo as kazoo_compat
from .client import log_failure

__all__ = ["Deferred", "give_up", "give_up_when_cut_off", "release_later", "start"]

logger = logging.getLogger(__name__)

#: Seconds a process that is shutting down waits for a lost connection to come
#: back before it gives that session up (:func:`give_up_when_cut_off`): a
#: dropped connection to a live ensemble is made again well within it.
SHUTDOWN_GRACE = 2.0

_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
_WAKE = object()   # a timer was set: look at the timers again
#: (when, order, callback) of what is due at a time (monotonic), earliest first.
_timers: list[tuple[float, int, Callable[[], None]]] = []
_timers_lock = threading.Lock()
_order = itertools.count()
_started = 0   # the pid whose thread runs
_start_lock = threading.Lock()
_sessions: Callable[[], list[Any]] = list


def start(sessions: Callable[[], list[Any]] | None = None) -> None:
    """Start this process's background thread unless it runs; ``sessions()``:
    the process's open sessions (to give up at a shutdown)."""
    global _started, _sessions
    if sessions is not None:
        _sessions = sessions
    with _start_lock:
        if _started != os.getpid():
            _started = os.getpid()
            threading.Thread(target=_run, name="celery_zk-background", daemon=True).start()


def release_later(lease: Any) -> None:
    """Release ``lease`` on the background thread (reentrant: safe from a weakref
    callback, on any thread, kazoo's included)."""
    _queue.put(lease)


def call_at(when: float, callback: Callable[[], None]) -> None:
    """Call ``callback`` on the background thread at ``when`` (monotonic); not
    from a finalizer or a signal handler (it takes a lock)."""
    start()
    with _timers_lock:
        heapq.heappush(_timers, (when, next(_order), callback))
    _queue.put(_WAKE)


class Deferred:
    """Background writes held back briefly, so they do not delay the write that matters.

    ZooKeeper syncs its log to disk once per batch of writes, and a write that
    arrives while a sync is under way waits for it to finish. An ack or an
    offer sent the moment a message is delivered starts such a sync just
    before the task writes its reply or result, which then waits a whole
    extra sync. Held back ``delay`` seconds (or until this process publishes,
    see :meth:`flush`), they go after that write, or with it, on the
    background thread. ``send`` callables must not block: each only enqueues
    a request.
    """

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self._pending: list[Callable[[], None]] = []
        self._due: float | None = None
        self._lock = threading.Lock()

    def later(self, send: Callable[[], None], delay: float | None = None) -> None:
        """Send ``send`` within ``delay`` seconds (default: the instance's)."""
        due = time.monotonic() + (self.delay if delay is None else delay)
        with self._lock:
            self._pending.append(send)
            sooner = self._due is None or due < self._due
            if sooner:
                self._due = due
        if sooner:
            call_at(due, self._when_due)

    def _when_due(self) -> None:
        due = self._due
        if due is not None and due <= time.monotonic():   # else flushed, or due later
            self.flush()

    def flush(self) -> None:
        """Send everything held back now (after a publish; before closing)."""
        with self._lock:
            pending, self._pending = self._pending, []
            self._due = None
        for send in pending:
            try:
                send()
            except Exception:   # a closed client: what was held back is redone or recovered
                logger.debug("celery_zk: deferred write failed", exc_info=True)


#: Set (from a signal handler) once this process began to shut down.
_shutting_down = False
#: While this says so, nothing is given up (see give_up_when_cut_off).
_busy: Callable[[], bool] | None = None


def give_up_when_cut_off(busy: Callable[[], bool] | None = None) -> None:
    """This process is shutting down (a worker's warm shutdown began). From
    now on, a session whose client has not been connected for
    :data:`SHUTDOWN_GRACE` seconds, counted while ``busy()`` is false, is
    given up (:func:`give_up`). ``busy``: a task of the worker
    still runs, and may yet store its result and send its ack through the
    session (a threads pool runs tasks in this process): those wait for the
    ensemble as they would without a shutdown.

    Without it a worker cut off from the ensemble never finished its warm
    shutdown: kazoo holds a request made while it reconnects until it is
    connected again, however long that takes, and the shutdown's tidying
    (offers withdrawn, inboxes given back, ephemeral nodes deleted) is such
    requests. Given up, each fails at once and is left to the session's end,
    which does the same as after a kill: its ephemeral nodes go, and recovery
    gives its messages back (at-least-once).

    Safe in a signal handler: it only sets a flag and wakes the background
    thread (``SimpleQueue.put`` is reentrant), which does the watching.
    """
    global _shutting_down, _busy
    _busy = busy
    _shutting_down = True
    _queue.put(_WAKE)


def _run() -> None:
    """Sends what is due; releases leases whose handles were garbage-collected
    (their finalizers may run on any thread, so they only queue the lease);
    once shutting down, also gives up sessions that stay cut off."""
    pid = os.getpid()
    cut_off_since: dict[Any, float] = {}
    while True:
        with _timers_lock:
            wait = max(0.0, _timers[0][0] - time.monotonic()) if _timers else None
        if _shutting_down:
            wait = 0.1 if wait is None else min(wait, 0.1)
        try:
            item = _queue.get(timeout=wait)
        except queue.Empty:
            item = None
        if pid != os.getpid():
            return
        now = time.monotonic()
        with _timers_lock:
            due = []
            while _timers and _timers[0][0] <= now:
                due.append(heapq.heappop(_timers)[2])
        for callback in due:
            try:
                callback()
            except Exception:   # one failure must not stop the others
                logger.exception("celery_zk: a background call failed")
        if _shutting_down:
            _give_up_cut_off(cut_off_since, _sessions())
        if item is None or item is _WAKE:
            continue
        try:
            item.session.release(item, wait=True)
        except Exception as exc:
            log_failure(logger, exc, "celery_zk: releasing a dropped connection's session "
                        "share failed")


def _give_up_cut_off(cut_off_since: dict[Any, float], sessions: list[Any],
                     now: float | None = None) -> None:
    now = time.monotonic() if now is None else now
    busy = _busy
    if busy is not None and busy():
        cut_off_since.clear()   # the grace starts once the last task ended
        return
    for session in sessions:
        client = session.current_client
        if client is None or client.state == KazooState.CONNECTED:
            cut_off_since.pop(session, None)
            continue
        since = cut_off_since.setdefault(session, now)
        if now - since >= SHUTDOWN_GRACE:
            give_up(session, now - since)


def give_up(session: Any, cut_off_for: float) -> None:
    """Stop the client of a session cut off from ZooKeeper while this process
    shuts down: each request waiting for a reconnect fails now, and every
    later one at once (:func:`give_up_when_cut_off`)."""
    client = session.current_client
    if client is None or session.pid != os.getpid() or session.given_up:
        return
    session.given_up = True
    logger.warning(
        "celery_zk: shutting down while cut off from ZooKeeper at %s for %.1f s: "
        "giving the session up. What this process held (messages given to it, its "
        "offers and registrations) goes back when ZooKeeper ends the session, up to "
        "session_timeout=%s s from now", session.settings.hosts, cut_off_for,
        session.settings.options.session_timeout)
    # kazoo's stop() waits for its connection thread, which may be reading a
    # connect reply that never comes (up to session_timeout s): stop on
    # another thread, and end that read once the stop is under way.
    stopper = threading.Thread(target=_stop_quietly, args=(client,),
                               name="celery_zk-give-up", daemon=True)
    stopper.start()
    deadline = time.monotonic() + session.settings.options.session_timeout + 5
    while stopper.is_alive() and time.monotonic() < deadline:
        stopper.join(0.05)
        kazoo_compat.abort_connect(client)


def _stop_quietly(client: KazooClient) -> None:
    try:
        client.stop()
    except Exception:   # its connection thread would not stop: the exit ends it
        logger.debug("celery_zk: stopping a cut-off client failed", exc_info=True)
