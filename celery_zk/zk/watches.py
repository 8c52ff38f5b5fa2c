"""Persistent recursive watches (ZooKeeper 3.6+ ``addWatch``) on top of kazoo.

One watch per directory a process follows; its events name the node, so
nothing is listed again. kazoo has no ``addWatch`` yet: the requests go
through kazoo's request queue and the events are read through the private
names fenced in :mod:`celery_zk.compat.kazoo`. The server forgets a
connection's watches when it drops, so each drop bumps a generation and a
watch counts as set only in the current one; its owner adds it again and
reads again. Callbacks run on kazoo's connection thread: they record the
event and wake someone, never make a request. One :class:`TreeWatches` per
session (callers pass :func:`~celery_zk.zk.session.weak_callback` wrappers).
docs/design.md, "Waiting: watches, not polling", has why.
"""
from __future__ import annotations

import logging
import threading
from collections import namedtuple
from collections.abc import Callable
from typing import Any, Protocol

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import UnimplementedError
from kazoo.protocol.serialization import int_struct, write_string

from ..compat import kazoo as kazoo_compat
from ..exceptions import ZKServerTooOld
from ..server.launcher import four_letter_word
from .client import dispose_later, make_client, unwaited
from .config import ZKSettings

__all__ = ["NODE_CREATED", "NODE_DELETED", "TreeWatches", "require_add_watch", "watches_of"]

logger = logging.getLogger(__name__)

NODE_CREATED = 1   # ZooKeeper's WatcherEvent types
NODE_DELETED = 2

_PERSISTENT_RECURSIVE = 1   # AddWatchMode
_ANY_WATCHER = 3            # WatcherType: removes every watch of ours on the path

#: ``callback(event_type, name)``: ``name`` is the path below the watched one
#: ("" for the watched node itself). Runs on kazoo's connection thread.
TreeCallback = Callable[[int, str], None]


#: Hosts whose servers are known to have addWatch (see require_add_watch).
_known: set[str] = set()
#: Where the check sets its watch: a node no one makes (a missing node has no ACL
#: to check), outside the chroot, and gone with the check's session.
PROBE_PATH = "/celery_zk-addWatch-probe"
#: The ZooKeeper release that brought addWatch (and multiRead).
NEEDED = "3.6"

#: How far below a watched path an event is handed to its callbacks: a
#: delayed message is three (delayed/{day}/{bucket}/{name}).
DEPTH = 3


class _PathAndInt(namedtuple("_PathAndInt", "path value")):
    """The wire form both requests share: a path and one int. The reply has no
    body to read (an ErrorResponse whose code the reply header already gave)."""

    type: int

    def serialize(self) -> bytearray:
        return bytearray(write_string(self.path) + int_struct.pack(self.value))

    @classmethod
    def deserialize(cls, _bytes: bytes, _offset: int) -> bool:
        return True


class AddWatch(_PathAndInt):
    type = 106   # value: the AddWatchMode


class RemoveWatches(_PathAndInt):
    type = 18    # value: the WatcherType


class WatchSource(Protocol):
    """A session: its client, its settings, and its state listeners."""

    @property
    def client(self) -> KazooClient: ...

    @property
    def settings(self) -> ZKSettings: ...

    def add_listener(self, listener: Callable[[KazooState], None]) -> None: ...


class TreeWatches:
    """The persistent recursive watches of one session's client."""

    def __init__(self, handle: WatchSource) -> None:
        self.handle = handle
        self._client: KazooClient | None = None
        self._generation = 0              # bumped on every connection drop
        self._added: dict[str, int] = {}  # path -> generation it was added in
        # Read by the connection thread; replaced, never mutated, so it needs no lock.
        self._callbacks: dict[str, frozenset[TreeCallback]] = {}
        self._lock = threading.Lock()
        handle.add_listener(self._on_state)

    # -- connection thread / kazoo listeners: never block ---------------------
    def _on_state(self, state: KazooState) -> None:
        if state != KazooState.CONNECTED:
            self._generation += 1   # the server dropped our watches with the connection

    def _dispatch(self, event_type: int, path: str) -> bool:
        """Hand an event to the callbacks of every watched path it falls under
        (up to :data:`DEPTH` levels up: a dispatcher watches ``owned/`` while a
        consumer of the same process watches its inbox below it), each with
        the path below its own ("" for the watched node itself)."""
        table = self._callbacks
        found = False
        watched, name = path, ""
        for _ in range(DEPTH + 1):
            callbacks = table.get(watched)
            if callbacks:
                found = True
                for callback in callbacks:
                    try:
                        callback(event_type, name)
                    except Exception:  # it would break kazoo's connection loop
                        logger.exception("celery_zk: watch callback for %s failed", path)
            watched, _, below = watched.rpartition("/")
            if not watched:
                break
            name = f"{below}/{name}" if name else below
        return found

    # -- the owner's thread ---------------------------------------------------
    def _bind(self) -> KazooClient:
        client = self.handle.client
        if client is not self._client:   # first use, or a new client after fork
            with self._lock:
                if client is not self._client:
                    kazoo_compat.intercept_watch_events(client, self._dispatch)
                    self._client = client
                    self._added.clear()
        return client

    def active(self, path: str) -> bool:
        """True when ``path`` is watched on the current connection."""
        return (self._client is self.handle.client
                and self._added.get(path) == self._generation)

    def watch(self, path: str, callback: TreeCallback) -> None:
        """Watch everything created, changed or deleted below ``path``.

        Sends ``addWatch`` unless it is already set on this connection (a
        reconnect needs it again).
        """
        client = self._bind()
        with self._lock:
            self._callbacks = {**self._callbacks,
                               path: self._callbacks.get(path, frozenset()) | {callback}}
        generation = self._generation   # read first: a drop meanwhile means "add again"
        if self._added.get(path) == generation:
            return
        request = AddWatch(client.chroot + path, _PERSISTENT_RECURSIVE)

        def add() -> None:
            kazoo_compat.send(client, request).get()

        client.retry(add)
        self._added[path] = generation

    def unwatch(self, path: str, callback: TreeCallback) -> bool:
        """Stop calling ``callback``; the last one out removes the server's watch.

        True when that removal was sent. ZooKeeper (3.8) removes watches only
        by path, so it also drops any one-shot watch this client holds there.
        """
        if not self._forget(path, callback) or self._added.pop(path, None) is None:
            return False
        client = self._client
        if client is None or client is not self.handle.client:
            return False
        # A watch not removed dies with the connection anyway.
        unwaited(kazoo_compat.send(client, RemoveWatches(client.chroot + path, _ANY_WATCHER)),
                 logger, "celery_zk: could not remove the watch on %s", path,
                 level=logging.DEBUG)
        return True

    def _forget(self, path: str, callback: TreeCallback) -> bool:
        """Drop ``callback``; True when no callback is left for ``path``."""
        with self._lock:
            left = self._callbacks.get(path, frozenset()) - {callback}
            callbacks = dict(self._callbacks)
            if left:
                callbacks[path] = left
            else:
                callbacks.pop(path, None)
            self._callbacks = callbacks
        return not left


def watches_of(session: Any) -> TreeWatches:
    """The one :class:`TreeWatches` of ``session`` (a ``SharedSession``)."""
    watches: TreeWatches = session.singleton(TreeWatches, lambda: TreeWatches(session))
    return watches


def require_add_watch(settings: ZKSettings, timeout: float | None = None) -> None:
    """Raise :class:`~celery_zk.exceptions.ZKServerTooOld` when the ensemble's
    servers do not know ``addWatch`` (ZooKeeper before 3.6); asked once per
    process and ensemble.

    A server before 3.6 answers an unknown request out of turn (ZooKeeper's
    UnimplementedRequestProcessor replies at once, ahead of the requests
    still in its pipeline, then closes the connection), and kazoo, seeing the
    reply's xid out of order, gives up on the client for good. So the
    question is never asked on a shared session: a client of its own asks
    it, and is thrown away (``timeout``: its connect timeout; a client that
    cannot connect raises as the session's own would). When it cannot be asked
    for another reason nothing is decided: the next session asks again.
    """
    if settings.hosts in _known:
        return
    probe = make_client(settings, timeout)
    try:
        kazoo_compat.send(probe, AddWatch(PROBE_PATH, _PERSISTENT_RECURSIVE)).get(
            timeout=settings.options.connect_timeout)
    except UnimplementedError:
        raise ZKServerTooOld(
            f"The ZooKeeper server at {settings.hosts} is {_version_of(settings)}; "
            f"celery_zk needs ZooKeeper {NEEDED} or newer (its consumers wait on "
            f"persistent watches, ZooKeeper {NEEDED}'s addWatch). Upgrade the "
            "ensemble (3.4 and 3.5 are end of life), or stay on celery_zk 0.3, which "
            "falls back to one-shot watches.") from None
    except Exception:   # the same: the shared session's requests will say it
        logger.debug("celery_zk: could not ask %s whether it has addWatch", settings.hosts,
                     exc_info=True)
        return
    finally:
        dispose_later(probe)
    _known.add(settings.hosts)


def _version_of(settings: ZKSettings) -> str:
    """The version a server of ``settings.hosts`` says it runs (four-letter word
    ``srvr``, whitelisted by default), or what the refusal tells."""
    for hostport in settings.hosts.split(","):
        host, _, port = hostport.rpartition(":")
        try:
            reply = four_letter_word(host.strip("[]"), int(port), "srvr")
        except (OSError, ValueError):
            continue
        for line in reply.splitlines():
            if line.startswith("Zookeeper version:"):
                return "ZooKeeper " + line.split(":", 1)[1].strip().split("-")[0]
    return "older than 3.6 (it does not know addWatch)"
