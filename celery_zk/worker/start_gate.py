"""A task starts only while the session it was delivered under is known live.

Once that session ends, recovery gives the task's message to another worker and
a revoke meanwhile may never reach this one. So a pool thread's start waits
while the client is cut off (``SUSPENDED``), makes one ``sync`` after a pause
(:class:`PauseMonitor`), and otherwise rests on an answer from the server in the
last :data:`FRESH` s; a task that must not start is dropped before Celery
accepts it (:func:`celery_zk.compat.celery_pool.gate_thread_task_starts`): its
message went back with the session. See ``docs/design.md``, "Not starting what
may be gone: the start gate".
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

from kazoo.client import KazooState

from ..broker.liveness import delivered_under
from ..zk.session import SharedSession

__all__ = ["PauseMonitor", "StartGate", "close_all", "start_gate"]

logger = logging.getLogger(__name__)

#: Seconds a tick may be late before the process counts as having been paused.
#: Far below any session timeout (ZooKeeper's least is 4 s), far above a busy
#: interpreter's scheduling delays.
PAUSE = 1.0
#: Seconds between the monitor's ticks.
TICK = 0.1
#: Seconds a server's answer counts as proof that the connection works. kazoo
#: notices a silent partition by a ping left unanswered, but a busy client never
#: sends one (its own requests keep its connection loop from idling), so it can
#: say CONNECTED through a whole partition: a start must rest on an answer.
FRESH = 1.0
#: A pause this long is logged as a warning; a shorter one (a process starved
#: of CPU for a second) at INFO.
PAUSE_WARNING = 3.0
#: Seconds a waiting start sleeps between looks (state changes wake it at once).
RECHECK = 0.5


class PauseMonitor:
    """A daemon thread that ticks every :data:`TICK` s and notes when a tick
    came :data:`PAUSE` s late: the whole process was stopped meanwhile."""

    def __init__(self) -> None:
        self.tick = time.monotonic()
        #: monotonic time a pause was noticed (by the thread's late tick).
        self.paused_at = float("-inf")
        self._thread = threading.Thread(target=self._run, name="celery_zk-pause-monitor",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            before = time.monotonic()
            time.sleep(TICK)
            now = time.monotonic()
            if now - before > PAUSE:
                self.paused_at = now
                logger.log(logging.WARNING if now - before >= PAUSE_WARNING else logging.INFO,
                           "celery_zk: this process was stopped for %.1f s (a pause, SIGSTOP, "
                           "a frozen host or no CPU); tasks start again once its ZooKeeper "
                           "session is known to live", now - before)
            self.tick = now

    def paused_since(self, since: float) -> bool:
        """Whether the process may have been paused after ``since`` (a monotonic
        time): a pause was noticed then, or the ticks are late right now (the
        caller woke before the monitor did)."""
        return self.paused_at >= since or time.monotonic() - self.tick > PAUSE


class StartGate:
    """Admits a task's start under one shared session (one per process)."""

    def __init__(self, session: SharedSession) -> None:
        self.session = session
        self.monitor = PauseMonitor()
        self.verified_at = time.monotonic()
        self._refreshing = False
        self.closing = False
        self._changed = threading.Condition()
        #: The session last connected (kazoo's ``client_id`` is None while
        #: SUSPENDED, when the session may well live); None once it is lost.
        self.known: int | None = None
        #: Wall times the client last lost its connection (SUSPENDED or LOST),
        #: and last (re)connected.
        self.cut_at = self.connected_at = float("-inf")
        session.add_listener(self._on_state)
        client = session.current_client
        if client is not None:
            self._on_state(client.state)

    def _on_state(self, state: KazooState) -> None:
        # kazoo's event thread: note the session, wake the starts that wait.
        client = self.session.current_client
        if state == KazooState.CONNECTED and client is not None and client.client_id:
            self.known = client.client_id[0]
        elif state == KazooState.LOST:
            self.known = None
        if state == KazooState.CONNECTED:
            self.connected_at = time.time()
        else:
            self.cut_at = time.time()
        with self._changed:
            self._changed.notify_all()

    def disturbed_since(self, wall: float) -> bool:
        """Whether this process may have lost touch with the ensemble after
        ``wall`` (a ``time.time()``): cut off, its session lost, reconnected or
        paused since then, or not connected now."""
        client = self.session.current_client
        if (client is None or client.state != KazooState.CONNECTED
                or max(self.cut_at, self.connected_at) >= wall):
            return True
        return self.monitor.paused_since(time.monotonic() - max(0.0, time.time() - wall))

    def close(self) -> None:
        """The worker is going: starts that wait for a server give up within
        :data:`RECHECK` s (their messages go back with the session). Takes no
        lock: Celery calls it from a signal handler."""
        self.closing = True

    def ticket(self, delivery_tag: str | None) -> int | None:
        """The session a task's message was delivered under (None: that
        registration has ended). Not the session now: Celery may hand the pool
        a task it received before a session loss it has not yet heard of (a
        countdown coming due)."""
        if delivery_tag is not None:
            ours, session_id = delivered_under(delivery_tag)
            if ours:
                return session_id
        return self.known   # a message not in an inbox: the session now

    def fresh(self, read_at: float | None = None) -> bool:
        """Whether the server answered in the last :data:`FRESH` s: a round trip of
        ours, or the read of the message at hand (``read_at``, monotonic)."""
        answered = self.verified_at if read_at is None else max(self.verified_at, read_at)
        return time.monotonic() - answered <= FRESH

    def refresh_async(self) -> None:
        """Start one round trip unless one is under way (never blocks): starts
        after its answer count as fresh."""
        client = self.session.current_client
        if self._refreshing or client is None or client.state != KazooState.CONNECTED:
            return
        self._refreshing = True
        started = time.monotonic()

        def done(result: Any) -> None:   # kazoo's thread: note, nothing else
            self._refreshing = False
            if result.successful() and self.verified_at < started:
                self.verified_at = started
        client.sync_async("/").rawlink(done)

    def admit(self, ticket: int | None, read_at: float | None = None) -> bool:
        """Whether a task handed over under ``ticket`` may start now (``read_at``:
        when its message was read, monotonic); blocks while the client is cut off,
        or for one round trip when the server has not answered lately. Runs in a
        pool thread, never in kazoo's."""
        while True:
            client = self.session.current_client
            if ticket is None or client is None:
                return False
            state, client_id = client.state, client.client_id
            if state == KazooState.LOST or (client_id and client_id[0] != ticket):
                return False   # that session ended: its messages went to others
            if state == KazooState.SUSPENDED or not client_id:   # (None: changing state)
                if self.closing:
                    return False   # a worker shutting down waits for no server
                with self._changed:
                    self._changed.wait(RECHECK)
                continue
            if not self.monitor.paused_since(self.verified_at) and self.fresh(read_at):
                return True
            self._verify(client)

    def _verify(self, client: Any) -> None:
        """One round trip (after a pause, or when the server has not answered
        lately): only a live session's working connection answers it."""
        started = time.monotonic()
        try:
            client.sync_async("/").get(timeout=max(self.session.settings.options.session_timeout,
                                                   RECHECK))
        except Exception as exc:   # lost, expired, timed out: the state tells, next look
            logger.debug("celery_zk: the session check failed: %r", exc)
            with self._changed:
                self._changed.wait(RECHECK / 10)
            return
        if self.verified_at < started:
            self.verified_at = started


#: Every gate of this process (one per session that has a worker's consumer).
_gates: weakref.WeakSet[StartGate] = weakref.WeakSet()


def start_gate(session: SharedSession) -> StartGate:
    """The gate of ``session`` (one per session, made on first use)."""
    gate = session.singleton(StartGate, lambda: StartGate(session))
    _gates.add(gate)
    return gate


def close_all() -> None:
    """The worker is shutting down: no start waits for a server any more (a
    thread pool's stop waits for its threads). Safe in a signal handler."""
    for gate in list(_gates):
        gate.close()
