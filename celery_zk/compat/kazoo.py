"""kazoo's private names, used for the requests kazoo has no method for.

kazoo (2.9 to 2.11) cannot send ZooKeeper 3.6's ``addWatch``,
``removeWatches`` (python-zk/kazoo#715 is unmerged) or ``multiRead``, nor
hand the events of a persistent watch to anyone: its connection drops an
event none of its own watchers asked for. :mod:`celery_zk.zk.watches` and
:mod:`celery_zk.zk.reads` therefore need these private names, all here:

* ``KazooClient._call(request, async_result)``: queue a request kazoo has no
  method for on kazoo's own request queue (Zuul sends ``addWatch`` the same
  way); kazoo's connection thread writes it and reads its reply;
* ``ConnectionHandler._read_watch_event(buffer, offset)``: wrapped, so the
  events of our watches are read before kazoo looks for its own watchers;
* ``KazooClient._data_watchers`` / ``_child_watchers``: whether kazoo has a
  watcher of its own on the event's path (then it gets the event too);
* ``ConnectionHandler._socket``: :func:`abort_connect` shuts down the socket
  of a client being stopped while it waits for a server that never answers
  (:func:`celery_zk.zk.background.give_up`): kazoo's connect
  attempt reads the server's reply for up to ``session_timeout`` s and looks
  at nothing else meanwhile, so its ``stop()`` waited that long.

Without the first four there is no persistent watch, and celery_zk's
consumers and dispatchers have nothing to wait on: :func:`require` refuses
to start, naming what is missing. Without ``_socket`` a stop waits for the
connect attempt to time out. ``docs/kazoo-patch.md`` is the change to kazoo
that would let this module go.
"""
from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import Watch

from . import PrivateAPIChanged, describe

__all__ = ["abort_connect", "intercept_watch_events", "missing", "require", "send"]

_USE = "to send addWatch, removeWatches and multiRead and read persistent watch events"
_CONSEQUENCE = "celery_zk cannot wait for messages without them."

#: Every private name this module needs: where it lives, and the attribute.
PRIVATE: tuple[tuple[type, str], ...] = (
    (KazooClient, "_call"),
    (ConnectionHandler, "_read_watch_event"),
)
#: Set in ``KazooClient.__init__``: checked on an instance.
PRIVATE_INSTANCE = ("_connection", "_data_watchers", "_child_watchers")


def _changed(name: str) -> PrivateAPIChanged:
    return PrivateAPIChanged(describe("kazoo", name, _USE, _CONSEQUENCE))


def missing(client: KazooClient | None = None) -> list[str]:
    """What the installed kazoo lacks of :data:`PRIVATE` (with ``client``, of
    :data:`PRIVATE_INSTANCE` too), one message each; empty when all is there."""
    problems = [str(_changed(f"{owner.__name__}.{name}"))
                for owner, name in PRIVATE if not callable(getattr(owner, name, None))]
    if client is not None:
        problems += [str(_changed(f"KazooClient().{name}"))
                     for name in PRIVATE_INSTANCE if not hasattr(client, name)]
        if not hasattr(getattr(client, "_connection", None), "_socket"):
            problems.append(describe("kazoo", "ConnectionHandler()._socket",
                                     "to stop a client whose connect attempt waits",
                                     "A stop waits for the attempt to time out."))
    return problems


def require() -> None:
    """Raise :class:`PrivateAPIChanged` naming what this kazoo lacks of what
    every consumer needs (checked once a transport is made)."""
    problems = [str(_changed(f"{owner.__name__}.{name}"))
                for owner, name in PRIVATE if not callable(getattr(owner, name, None))]
    if problems:
        raise PrivateAPIChanged("\n".join(problems))


def send(client: KazooClient, request: Any) -> Any:
    """Queue ``request`` (a kazoo-style request object) on ``client``'s
    connection; its async result. Raises :class:`PrivateAPIChanged` when kazoo
    cannot."""
    call = getattr(client, "_call", None)
    if call is None:
        raise _changed("KazooClient._call")
    result = client.handler.async_result()
    call(request, result)
    return result


def intercept_watch_events(client: KazooClient,
                           ours: Callable[[int, str], bool]) -> None:
    """Show every watch event of ``client`` to ``ours(type, path)`` first (on
    kazoo's connection thread; ``path`` without the chroot). An event ``ours``
    returns True for goes to kazoo's own watchers only if one of them watches
    that path too. Raises :class:`PrivateAPIChanged` when kazoo's internals differ.
    """
    connection = getattr(client, "_connection", None)
    original = getattr(connection, "_read_watch_event", None)
    if original is None:
        raise _changed("ConnectionHandler._read_watch_event")
    if getattr(client, "_data_watchers", None) is None or getattr(
            client, "_child_watchers", None) is None:
        raise _changed("KazooClient._data_watchers/_child_watchers")

    def read_watch_event(buffer: bytes, offset: int) -> None:
        watch, _ = Watch.deserialize(buffer, offset)
        taken = ours(watch.type, client.unchroot(watch.path))
        # kazoo replaces these dicts on a session change: read them each time.
        if (not taken or watch.path in client._data_watchers
                or watch.path in client._child_watchers):
            original(buffer, offset)   # kazoo's own watchers

    connection._read_watch_event = read_watch_event  # type: ignore[union-attr]


def abort_connect(client: KazooClient) -> bool:
    """Shut down the socket of ``client``'s connection, so that a read waiting
    on it (a connect attempt to a server that never answers) ends now; False
    when there is none (or kazoo's internals differ: the read then ends at
    its timeout). Only for a client being stopped: kazoo would reconnect."""
    sock = getattr(getattr(client, "_connection", None), "_socket", None)
    if sock is None:
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False   # closed meanwhile, or never connected
    return True
