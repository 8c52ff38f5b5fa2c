"""A process's releases in the background: the leases of handles that were
garbage-collected, and, once a worker shuts down, sessions cut off from
ZooKeeper too long (:func:`give_up_when_cut_off`).

A worker shutting down while cut off from ZooKeeper gives its sessions up:
kazoo holds a request made while it reconnects until it is connected again,
so each step of the warm shutdown (an offer withdrawn, an inbox given back)
would wait for the outage to end.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient, KazooState

from ..compat import kazoo as kazoo_compat
from .client import log_failure
from .process import current_pid

__all__ = ["give_up", "give_up_when_cut_off", "release_later", "start"]

logger = logging.getLogger(__name__)

#: Seconds a process that is shutting down waits for a lost connection to come
#: back before it gives that session up (:func:`give_up_when_cut_off`): a
#: dropped connection to a live ensemble is made again well within it.
SHUTDOWN_GRACE = 2.0

_release_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()


def start(sessions: Callable[[], list[Any]]) -> None:
    """Start this process's release thread; ``sessions()``: its open sessions."""
    threading.Thread(target=_release_forever, args=(sessions,), name="celery_zk-release",
                     daemon=True).start()


def release_later(lease: Any) -> None:
    """Release ``lease`` on the release thread (reentrant: safe from a weakref
    callback, on any thread, kazoo's included)."""
    _release_queue.put(lease)


#: Set (from a signal handler) once this process began to shut down.
_shutting_down = False
_GIVE_UP = object()   # wakes the release thread to watch for cut-off sessions
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

    Safe in a signal handler: it only sets a flag and wakes the release
    thread (``SimpleQueue.put`` is reentrant), which does the watching.
    """
    global _shutting_down, _busy
    _busy = busy
    _shutting_down = True
    _release_queue.put(_GIVE_UP)


def _release_forever(sessions: Callable[[], list[Any]]) -> None:
    """Releases leases whose handles were garbage-collected (their finalizers
    may run on any thread, kazoo's included, so they only queue the lease);
    once shutting down, also gives up sessions that stay cut off."""
    pid = current_pid()
    cut_off_since: dict[Any, float] = {}
    while True:
        try:
            lease = _release_queue.get(timeout=0.1 if _shutting_down else None)
        except queue.Empty:
            lease = None
        if pid != current_pid():
            return
        if _shutting_down:
            _give_up_cut_off(cut_off_since, sessions())
        if lease is None or lease is _GIVE_UP:
            continue
        try:
            lease.session.release(lease, wait=True)
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
    if client is None or session.pid != current_pid() or session.given_up:
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
