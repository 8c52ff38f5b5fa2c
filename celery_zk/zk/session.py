"""One ZooKeeper session per ensemble per process, shared by everything in it.

Curator's rule: a session is server state (a connection slot, a tracker
entry, its watches), so every connection, pool, backend and result consumer
of a process that names the same ensemble and settings shares one kazoo
client (:class:`SharedSession`). Each user holds a :class:`ClientHandle`, a
lease on it: what a lease makes for its owner alone is deleted when it ends
(``close()``, or its owner garbage-collected: nothing of kazoo's holds an
owner strongly), and the last lease closes the session. The registry is per
process: a handle used after ``fork()`` leases the child's own session and
never touches the parent's client. docs/design.md, "One session per
process", has the rest (:mod:`.held`, :mod:`.background`).
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.util import Finalize
from typing import Any, TypeVar

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import ConnectionClosedError, NoNodeError

from .background import Deferred, release_later
from .background import start as start_background
from .client import CONNECTION_ERRORS, check_root, log_failure, make_client
from .config import ZKSettings
from .held import HeldNodes
from .watches import require_add_watch

__all__ = ["AfterExpiry", "ClientHandle", "SharedSession", "session_key",
           "weak_callback"]

logger = logging.getLogger(__name__)

#: Seconds acks and offers are held back (see Deferred): longer than a fast
#: task's reply takes to be sent, short enough to be invisible otherwise.
DEFERRED_WRITE_DELAY = 0.005


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
        self.pid = os.getpid()
        self.deferred = Deferred(DEFERRED_WRITE_DELAY)
        self._client: KazooClient | None = None
        self._lock = threading.RLock()
        self._handles: weakref.WeakSet[ClientHandle] = weakref.WeakSet()
        self._listeners: list[Callable[[KazooState], None]] = []
        #: Ephemeral nodes several leases need (counted; see celery_zk.zk.held).
        self.held = HeldNodes(lambda: self._client, weak_callback)
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
                require_add_watch(self.settings, timeout)   # 3.6 or newer, or a clear error
                client = make_client(self.settings, timeout)
                client.add_listener(self._on_state)
                self._client = client
            return self._client

    @property
    def client(self) -> KazooClient:
        return self.connect()

    @property
    def current_client(self) -> KazooClient | None:
        """The client if there is one, never making one (None once closed)."""
        return self._client

    def _on_state(self, state: KazooState) -> None:
        # kazoo's event thread: the listeners only flag and wake.
        for listener in list(self._listeners):
            listener(state)
        if state == KazooState.CONNECTED:
            self.held.wake()   # borrowed nodes to look at again (reclaim): now it can
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
        hands the work to the background thread."""
        if not wait:
            release_later(lease)
            return
        if self.pid != os.getpid():
            return   # the parent's session, inherited by fork: not ours to touch
        try:
            if self._client is not None and not self.closed:
                self._delete_owned(lease)
                for path in list(lease.held):
                    self.held.release(lease.token, path)
                    lease.held.discard(path)
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

    def close(self) -> None:
        """Stop the client (the session ends: ZooKeeper drops its ephemeral nodes)."""
        for callback in self._on_close:
            try:
                callback()
            except Exception:
                logger.exception("celery_zk: a session close hook failed")
        self.deferred.flush()
        client, self._client = self._client, None
        if client is not None and self.pid == os.getpid():
            try:
                client.stop()
            finally:
                client.close()


class ClientHandle:
    """One user's lease on its process's :class:`SharedSession` for ``settings``.

    Taken on first use of :attr:`client` (so an unused handle costs nothing),
    ended by :meth:`close` or garbage collection, and taken again if used after
    a close.
    """

    def __init__(self, settings: ZKSettings, connect_timeout: float | None = None) -> None:
        self.settings = settings
        self.connect_timeout = connect_timeout
        self._lease: _Lease | None = None
        self._finalizer: weakref.finalize | None = None
        self._pid = 0
        self._lock = threading.Lock()
        self._listeners: list[Callable[[KazooState], None]] = []

    # -- the lease ------------------------------------------------------------------
    def _current(self) -> _Lease:
        lease = self._lease
        if lease is not None and self._pid == os.getpid() and not lease.session.closed:
            return lease
        with self._lock:
            lease = self._lease
            if lease is None or self._pid != os.getpid() or lease.session.closed:
                if lease is not None and self._pid == os.getpid():
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
                self._lease, self._pid = lease, os.getpid()
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
        return lease is not None and self._pid == os.getpid() and not lease.session.closed

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
            if lease is not None and self._pid == os.getpid():
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
        lease.session.held.hold(lease.session.client, lease.token, path)
        lease.held.add(path)

    def release_held(self, path: str) -> None:
        lease = self._lease
        if lease is not None and self._pid == os.getpid():
            lease.held.discard(path)
            lease.session.held.release(lease.token, path)

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


# -- the registry ---------------------------------------------------------------------
_registry: dict[tuple[Any, ...], SharedSession] = {}
_registry_lock = threading.Lock()
_registry_pid = 0


def _register(settings: ZKSettings) -> SharedSession:
    """The session for ``settings``, with one more lease counted on it."""
    global _registry_pid
    with _registry_lock:
        if _registry_pid != os.getpid():   # a new process: nothing inherited is ours
            _registry.clear()
            _registry_pid = os.getpid()
            start_background(sessions)
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
        return list(_registry.values()) if _registry_pid == os.getpid() else []


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
