"""One ZooKeeper session per ensemble per process, shared by everything in it.

A ZooKeeper session is server state: a connection slot (60 per client IP by
default, ``maxClientCnxns``), a session-tracker entry and the watches it
holds. Curator's rule is one client per ensemble per process, and so it is
here: every kombu Connection, channel, producer pool, result backend and
result consumer of a process that names the same hosts, credentials, TLS
settings, ``session_timeout`` and ``session_name`` shares one kazoo client
(:class:`SharedSession`), counted by reference.

Each user holds a :class:`ClientHandle`, a *lease* on that session. What a
lease makes for its owner alone (a consumer's registration, its offers, the
holders of its auto-delete queues) is recorded on the lease and deleted when
the lease ends; ephemeral nodes that several leases need (the binding of a
reply queue two connections consume) are counted and deleted by the last.
A lease ends with ``close()``, or when its owner is garbage-collected: kazoo
keeps no strong reference to any owner (state listeners are dispatched through
a weak set, watch callbacks are wrapped by :func:`weak_callback`), so a
Connection dropped without ``close()`` releases its share; the last share
closes the session.

A session loss (expiry) still affects every user of the process, which is the
liveness the design relies on: each one re-creates what it owns.

A worker shutting down while cut off from ZooKeeper gives its sessions up
(:func:`give_up_when_cut_off`): kazoo holds a request made while it
reconnects until it is connected again, so each step of the warm shutdown
(an offer withdrawn, an inbox given back) would wait for the outage to end.

Fork safety: the registry is per process. A handle used in a child after
``fork()`` takes a lease on the child's own session and never touches the
parent's client (closing it would end the parent's session).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.util import Finalize
from typing import Any, TypeVar

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import ConnectionClosedError, NodeExistsError, NoNodeError

from ..compat import kazoo as kazoo_compat
from .client import CONNECTION_ERRORS, Deferred, check_root, log_failure, make_client
from .config import ZKSettings
from .process import current_pid
from .watches import require_add_watch

__all__ = ["AfterExpiry", "ClientHandle", "SharedSession", "give_up_when_cut_off", "session_key",
           "weak_callback"]

logger = logging.getLogger(__name__)

#: Seconds acks and offers are held back (see Deferred): longer than a fast
#: task's reply takes to be sent, short enough to be invisible otherwise.
DEFERRED_WRITE_DELAY = 0.005

#: Seconds a process that is shutting down waits for a lost connection to come
#: back before it gives that session up (:func:`give_up_when_cut_off`): a
#: dropped connection to a live ensemble is made again well within it.
SHUTDOWN_GRACE = 2.0

T = TypeVar("T")


def session_key(settings: ZKSettings) -> tuple[Any, ...]:
    """What makes two users need different sessions (everything kazoo is built from
    but the connect timeout and the root, which each lease checks for itself)."""
    opts = settings.options
    return (settings.hosts, settings.username, settings.password, opts.session_timeout,
            opts.acl, opts.read_only_users, opts.use_ssl, opts.ca, opts.certfile,
            opts.keyfile, opts.keyfile_password, opts.verify_certs, opts.session_name)


def weak_callback(method: Callable[..., T], dead: Any = None) -> Callable[..., T]:
    """``method`` (a bound method) for kazoo to call, without keeping its object alive.

    Once the object is gone the callback returns ``dead`` (False stops a
    kazoo ``ChildrenWatch``). Make one per object and reuse it: kazoo keeps a
    set of one-shot watchers per path, and the same callable is kept once.
    """
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        target = ref()
        return dead if target is None else target(*args)

    return call


@dataclass(eq=False)
class _Lease:
    """What one handle holds on its session. Kept apart from the handle, so a
    handle that is garbage-collected can still be released."""

    session: SharedSession
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    #: Ephemeral nodes made for this lease alone, deleted newest first at release.
    owned: dict[str, None] = field(default_factory=dict)
    #: Ephemeral nodes this lease holds a count on (see SharedSession.hold).
    held: set[str] = field(default_factory=set)


class SharedSession:
    """One kazoo client and the process-wide duties that go with it."""

    def __init__(self, key: tuple[Any, ...], settings: ZKSettings) -> None:
        self.key = key
        self.settings = settings
        self.leases = 0
        self.closed = False
        self.given_up = False   # cut off while shutting down: see give_up
        self.pid = current_pid()
        self.deferred = Deferred(DEFERRED_WRITE_DELAY)
        self._client: KazooClient | None = None
        self._lock = threading.RLock()
        self._handles: weakref.WeakSet[ClientHandle] = weakref.WeakSet()
        self._listeners: list[Callable[[KazooState], None]] = []
        self._held: dict[str, set[str]] = {}   # shared ephemeral path -> lease tokens
        self._borrowed: set[str] = set()   # held paths another session made (watched)
        self._lost: set[str] = set()       # of those, gone: to make again (reclaim)
        self._wakers: list[Callable[[], None]] = []
        self._gone_cb = weak_callback(self._on_gone)
        self._singletons: dict[Any, Any] = {}
        self._on_close: list[Callable[[], None]] = []
        #: Roots whose existence and ACL a lease has checked (see client.check_root).
        self.roots: set[str] = set()

    # -- the client -------------------------------------------------------------
    def connect(self, timeout: float | None = None) -> KazooClient:
        """The started client, connecting now if needed (``timeout``: seconds)."""
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self.closed:
                raise ConnectionClosedError("celery_zk: this ZooKeeper session was closed")
            if self._client is None:
                require_add_watch(self.settings)   # 3.6 or newer: a clear error if not
                client = make_client(self.settings, timeout)
                client.add_listener(self._on_state)
                self._client = client
            return self._client

    @property
    def client(self) -> KazooClient:
        return self.connect()

    @property
    def started(self) -> bool:
        return self._client is not None

    @property
    def current_client(self) -> KazooClient | None:
        """The client if there is one, never making one (None once closed)."""
        return self._client

    def _on_state(self, state: KazooState) -> None:
        # kazoo's event thread: the listeners only flag and wake.
        for listener in list(self._listeners):
            listener(state)
        if state == KazooState.CONNECTED and self._lost:
            for wake in list(self._wakers):
                wake()   # borrowed nodes to look at again (reclaim): now it can
        for handle in list(self._handles):
            handle._dispatch(state)

    def add_listener(self, listener: Callable[[KazooState], None]) -> None:
        """A session-wide state listener (kazoo's event thread: must not block)."""
        self._listeners.append(listener)

    def singleton(self, key: Any, make: Callable[[], T]) -> T:
        """The one object of a kind this session has (tree watches, recovery per root)."""
        with self._lock:
            found = self._singletons.get(key)
            if found is None:
                found = self._singletons[key] = make()
            return found

    def on_close(self, callback: Callable[[], None]) -> None:
        self._on_close.append(callback)

    # -- leases -------------------------------------------------------------------
    def _lease(self, handle: ClientHandle) -> _Lease:
        self._handles.add(handle)
        return _Lease(self)

    def release(self, lease: _Lease, wait: bool) -> None:
        """End a lease: delete what it owned, drop its counts, and close the
        session after the last one. ``wait=False`` (a garbage-collected handle)
        hands the work to the release thread."""
        if not wait:
            _release_queue.put(lease)   # reentrant: safe from a weakref callback
            return
        if self.pid != current_pid():
            return   # the parent's session, inherited by fork: not ours to touch
        try:
            if self._client is not None and not self.closed:
                self._delete_owned(lease)
                for path in list(lease.held):
                    self.release_held(lease, path)
        finally:
            _unregister(self)

    def _delete_owned(self, lease: _Lease) -> None:
        client = self._client
        assert client is not None
        paths = list(reversed(lease.owned))   # newest first: offers before their consumer
        lease.owned.clear()
        # Bounded: a close must not hang on a server that is away.
        timeout = self.settings.options.session_timeout
        try:
            for result in [client.delete_async(path) for path in paths]:
                try:
                    result.get(timeout=timeout)
                except NoNodeError:
                    pass
        except CONNECTION_ERRORS as exc:
            # They go with the session if it ends; if it lives on, they linger.
            log_failure(logger, exc, "celery_zk: could not delete %d ephemeral node(s) of "
                        "a closed connection", len(paths))

    def hold(self, lease: _Lease, path: str) -> None:
        """Create ephemeral ``path`` (if missing) and count ``lease`` as a holder."""
        with self._lock:   # against a last release deleting it meanwhile
            self._make_held(self.client, path)
            self._held.setdefault(path, set()).add(lease.token)
            lease.held.add(path)

    def _make_held(self, client: KazooClient, path: str) -> bool:
        """Make ``path`` ours, or watch another session's node of that name;
        True when this call created it."""
        try:
            client.retry(client.create, path, ephemeral=True, makepath=True)
            return True
        except NodeExistsError:
            pass
        # Another session's (a process killed a moment ago, whose session lives
        # until its timeout, under the same node name; or another live holder):
        # it goes with that session, and ours must be there then. Watched, and
        # made again by reclaim() once it is gone. Marked before the watch is
        # set: the deletion may be reported before exists() returns here.
        self._borrowed.add(path)
        stat = client.retry(client.exists, path, watch=self._gone_cb)
        if stat is None:
            self._borrowed.discard(path)
            return self._make_held(client, path)   # gone meanwhile
        if stat.ephemeralOwner == client.client_id[0]:
            self._borrowed.discard(path)   # ours already (a retried create)
        return False

    def _on_gone(self, event: Any) -> None:
        # kazoo's event thread: flag and wake, nothing else.
        if event.path is None:
            # A dropped connection: kazoo dropped every watch with it (and the
            # server too; kazoo sends no SetWatches), so the deletion would never
            # be told. Look at each borrowed node again once connected.
            self._lost.update(list(self._borrowed))
        elif event.path in self._borrowed:
            self._lost.add(event.path)   # deleted; any other event used the watch up
        else:
            return
        for wake in list(self._wakers):
            wake()

    def on_reclaim_needed(self, wake: Callable[[], None]) -> None:
        """``wake`` is called (kazoo's thread) when an ephemeral node this session
        holds but another session had made is gone, or its watch was dropped
        with a connection: call :meth:`reclaim`."""
        self._wakers.append(wake)

    def remake_held(self, path: str) -> None:
        """Make a held node again (after a session expiry), watching it if
        another session has it."""
        with self._lock:
            self._make_held(self.client, path)

    def reclaim(self) -> list[str]:
        """Make again the held nodes whose other session ended, and watch again
        those whose watch went with a connection (from any thread but kazoo's;
        a no-op unless some need it, or while not connected: the client's
        reconnect wakes the caller again). The paths made again."""
        made: list[str] = []
        client = self._client
        if not self._lost or client is None or client.state != KazooState.CONNECTED:
            return made
        with self._lock:
            while self._lost:
                path = self._lost.pop()
                self._borrowed.discard(path)
                if path not in self._held:
                    continue
                try:
                    created = self._make_held(client, path)
                except CONNECTION_ERRORS:
                    self._lost.add(path)   # the next call, once connected again
                    break
                if created:
                    made.append(path)
                    logger.info("celery_zk: made %s again: the session that had made it "
                                "ended", path)
        return made

    def release_held(self, lease: _Lease, path: str) -> None:
        """Drop ``lease``'s count on ``path``; the last holder deletes it."""
        with self._lock:
            lease.held.discard(path)
            holders = self._held.get(path)
            if holders is None:
                return
            holders.discard(lease.token)
            if holders:
                return
            del self._held[path]
            client = self._client
            if client is None:
                return
            try:
                client.retry(client.delete, path)
            except NoNodeError:
                pass

    def held_paths(self) -> list[str]:
        """Every counted ephemeral node (re-made after a session expiry)."""
        with self._lock:
            return list(self._held)

    def give_up(self, cut_off_for: float) -> None:
        """Stop the client of a session cut off from ZooKeeper while this process
        shuts down: each request waiting for a reconnect fails now, and every
        later one at once (:func:`give_up_when_cut_off`)."""
        client = self._client
        if client is None or self.pid != current_pid() or self.given_up:
            return
        self.given_up = True
        logger.warning(
            "celery_zk: shutting down while cut off from ZooKeeper at %s for %.1f s: "
            "giving the session up. What this process held (messages given to it, its "
            "offers and registrations) goes back when ZooKeeper ends the session, up to "
            "session_timeout=%s s from now", self.settings.hosts, cut_off_for,
            self.settings.options.session_timeout)
        # kazoo's stop() waits for its connection thread, which may be reading a
        # connect reply that never comes (up to session_timeout s): stop on
        # another thread, and end that read once the stop is under way.
        stopper = threading.Thread(target=self._stop_quietly, args=(client,),
                                   name="celery_zk-give-up", daemon=True)
        stopper.start()
        deadline = time.monotonic() + self.settings.options.session_timeout + 5
        while stopper.is_alive() and time.monotonic() < deadline:
            stopper.join(0.05)
            kazoo_compat.abort_connect(client)

    @staticmethod
    def _stop_quietly(client: KazooClient) -> None:
        try:
            client.stop()
        except Exception:   # its connection thread would not stop: the exit ends it
            logger.debug("celery_zk: stopping a cut-off client failed", exc_info=True)

    def close(self) -> None:
        """Stop the client (the session ends: ZooKeeper drops its ephemeral nodes)."""
        for callback in self._on_close:
            try:
                callback()
            except Exception:
                logger.exception("celery_zk: a session close hook failed")
        self.deferred.close()
        client, self._client = self._client, None
        if client is not None and self.pid == current_pid():
            try:
                client.stop()
            finally:
                client.close()


class ClientHandle:
    """One user's lease on its process's :class:`SharedSession` for ``settings``.

    Taken on first use of :attr:`client` (so an unused handle costs nothing),
    ended by :meth:`close` or garbage collection, and taken again if used after
    a close. ``owner``: the object whose peers :meth:`peers` finds (the
    transport), held weakly.
    """

    def __init__(self, settings: ZKSettings, connect_timeout: float | None = None,
                 owner: object | None = None) -> None:
        self.settings = settings
        self.connect_timeout = connect_timeout
        self._owner = weakref.ref(owner) if owner is not None else None
        self._lease: _Lease | None = None
        self._finalizer: weakref.finalize | None = None
        self._pid = 0
        self._lock = threading.Lock()
        self._listeners: list[Callable[[KazooState], None]] = []

    # -- the lease ------------------------------------------------------------------
    def _current(self) -> _Lease:
        lease = self._lease
        if lease is not None and self._pid == current_pid() and not lease.session.closed:
            return lease
        with self._lock:
            lease = self._lease
            if lease is None or self._pid != current_pid() or lease.session.closed:
                if lease is not None and self._pid == current_pid():
                    self._end(lease, wait=True)   # its session closed under it
                session = _register(self.settings)
                try:
                    client = session.connect(self.connect_timeout)
                    if self.settings.root not in session.roots:   # once per session
                        check_root(client, self.settings)
                        session.roots.add(self.settings.root)
                except BaseException:
                    _unregister(session)
                    raise
                lease = session._lease(self)
                self._finalizer = weakref.finalize(self, session.release, lease, False)
                self._finalizer.atexit = False   # at exit the registry closes every session
                self._lease, self._pid = lease, current_pid()
            return lease

    @property
    def session(self) -> SharedSession:
        return self._current().session

    @property
    def client(self) -> KazooClient:
        return self._current().session.client

    def connect(self) -> KazooClient:
        """Connect now (the client is otherwise made on first use)."""
        return self.client

    @property
    def started(self) -> bool:
        """This process holds a lease (and so a connected client) through this handle."""
        lease = self._lease
        return lease is not None and self._pid == current_pid() and not lease.session.closed

    @property
    def token(self) -> str:
        """Unique to this lease: names what it alone owns (an auto-delete queue's holder)."""
        return self._current().token

    @property
    def deferred(self) -> Deferred:
        return self._current().session.deferred

    def close(self) -> None:
        """End the lease now (deleting what it owns); a later use takes a new one."""
        with self._lock:
            lease, self._lease = self._lease, None
            if lease is not None and self._pid == current_pid():
                self._end(lease, wait=True)

    def _end(self, lease: _Lease, wait: bool) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        lease.session.release(lease, wait)

    # -- what the lease owns --------------------------------------------------------
    def own(self, path: str) -> None:
        """``path`` is an ephemeral node made for this user alone: deleted at release."""
        self._current().owned[path] = None

    def disown(self, path: str) -> None:
        """``path`` was deleted (or handed on): no longer this lease's to delete."""
        lease = self._lease
        if lease is not None:
            lease.owned.pop(path, None)

    def hold(self, path: str) -> None:
        """Create (if needed) and hold a count on ephemeral ``path``, shared with others."""
        lease = self._current()
        lease.session.hold(lease, path)

    def release_held(self, path: str) -> None:
        lease = self._lease
        if lease is not None and self._pid == current_pid():
            lease.session.release_held(lease, path)

    # -- state listeners ------------------------------------------------------------
    def add_listener(self, listener: Callable[[KazooState], None]) -> None:
        """Called on this handle's session's state changes (kazoo's event thread:
        must not block). Held by the handle, so it never keeps the handle alive."""
        self._listeners.append(listener)

    def _dispatch(self, state: KazooState) -> None:
        for listener in list(self._listeners):
            try:
                listener(state)
            except Exception:   # one listener's bug must not starve the others
                logger.exception("celery_zk: a connection state listener failed")

    def peers(self) -> Iterator[Any]:
        """The owners of every live handle on this handle's session, this one's included."""
        for handle in list(self._current().session._handles):
            owner = handle._owner() if handle._owner is not None else None
            if owner is not None:
                yield owner


# -- the registry ---------------------------------------------------------------------
_registry: dict[tuple[Any, ...], SharedSession] = {}
_registry_lock = threading.Lock()
_registry_pid = 0
_release_queue: queue.SimpleQueue[_Lease] = queue.SimpleQueue()


def _register(settings: ZKSettings) -> SharedSession:
    """The session for ``settings``, with one more lease counted on it."""
    global _registry_pid
    with _registry_lock:
        if _registry_pid != current_pid():   # a new process: nothing inherited is ours
            _registry.clear()
            _registry_pid = current_pid()
            _start_release_thread()
            Finalize(None, close_all, exitpriority=10)   # after unconfirmed flushes (100)
        key = session_key(settings)
        session = _registry.get(key)
        if session is None:
            session = _registry[key] = SharedSession(key, settings)
        session.leases += 1
        return session


def _unregister(session: SharedSession) -> None:
    """One lease fewer; the last one closes the session."""
    with _registry_lock:
        session.leases -= 1
        if session.leases > 0 or session.closed:
            return
        session.closed = True
        if _registry.get(session.key) is session:
            del _registry[session.key]
    session.close()


def sessions() -> list[SharedSession]:
    """This process's open sessions (for tests and diagnostics)."""
    with _registry_lock:
        return list(_registry.values()) if _registry_pid == current_pid() else []


def close_all(hosts: str | None = None) -> int:
    """End every session of this process now (only those on ``hosts``, if given),
    leases or not; returns how many. A later use starts a new session.

    Run at interpreter exit, so ZooKeeper drops their ephemeral nodes at once
    instead of a session timeout later; and by the pytest plugin before it
    stops its server, so pooled connections (kombu keeps pools for the life
    of the process) do not outlive it and retry against a stopped server.
    """
    closed = 0
    for session in sessions():
        if hosts is not None and session.settings.hosts != hosts:
            continue
        with _registry_lock:
            session.closed = True
            _registry.pop(session.key, None)
        try:
            session.close()
            closed += 1
        except Exception:
            logger.debug("celery_zk: closing a session failed", exc_info=True)
    return closed


def _start_release_thread() -> None:
    threading.Thread(target=_release_forever, name="celery_zk-release", daemon=True).start()


#: Set (from a signal handler) once this process began to shut down.
_shutting_down = False
_GIVE_UP = object()   # wakes the release thread to watch for cut-off sessions
#: While this says so, nothing is given up (see give_up_when_cut_off).
_busy: Callable[[], bool] | None = None


def give_up_when_cut_off(busy: Callable[[], bool] | None = None) -> None:
    """This process is shutting down (a worker's warm shutdown began). From
    now on, a session whose client has not been connected for
    :data:`SHUTDOWN_GRACE` seconds, counted while ``busy()`` is false, is
    given up (:meth:`SharedSession.give_up`). ``busy``: a task of the worker
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
    _release_queue.put(_GIVE_UP)  # type: ignore[arg-type]


def _release_forever() -> None:
    """Releases leases whose handles were garbage-collected (their finalizers
    may run on any thread, kazoo's included, so they only queue the lease);
    once shutting down, also gives up sessions that stay cut off."""
    pid = current_pid()
    cut_off_since: dict[SharedSession, float] = {}
    while True:
        try:
            lease = _release_queue.get(timeout=0.1 if _shutting_down else None)
        except queue.Empty:
            lease = None
        if pid != current_pid():
            return
        if _shutting_down:
            _give_up_cut_off(cut_off_since)
        if lease is None or lease is _GIVE_UP:
            continue
        try:
            lease.session.release(lease, wait=True)
        except Exception as exc:
            log_failure(logger, exc, "celery_zk: releasing a dropped connection's session "
                        "share failed")


def _give_up_cut_off(cut_off_since: dict[SharedSession, float],
                     now: float | None = None) -> None:
    now = time.monotonic() if now is None else now
    busy = _busy
    if busy is not None and busy():
        cut_off_since.clear()   # the grace starts once the last task ended
        return
    for session in sessions():
        client = session.current_client
        if client is None or client.state == KazooState.CONNECTED:
            cut_off_since.pop(session, None)
            continue
        since = cut_off_since.setdefault(session, now)
        if now - since >= SHUTDOWN_GRACE:
            session.give_up(now - since)


class AfterExpiry:
    """Re-creates what a session expiry removed (ephemeral nodes), once connected again.

    kazoo reports the expiry on its event thread, which must not block, so
    the listener only raises a flag; the owner calls this object from its own
    thread (the transport's drain loop, or before a request) and ``restore``
    runs there. A no-op until the client is connected, so the caller never
    blocks on a server that is away; a failed restore is retried next call.
    """

    def __init__(self, handle: ClientHandle, restore: Callable[[KazooClient], None]) -> None:
        self.handle = handle
        self._restore = restore
        self._pending = False
        self._lock = threading.Lock()
        handle.add_listener(self._on_state)

    def _on_state(self, state: KazooState) -> None:
        if state == KazooState.LOST:
            self._pending = True

    def __call__(self) -> None:
        if not self._pending or self.handle.client.state != KazooState.CONNECTED:
            return
        with self._lock:
            if self._pending:
                self._restore(self.handle.client)
                self._pending = False  # only now: a failure above leaves it to the next call
