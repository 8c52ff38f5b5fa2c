"""kazoo's private names, used for the requests kazoo has no method for.

kazoo (2.9 to 2.11) cannot send ZooKeeper 3.6's ``addWatch``,
``removeWatches`` (python-zk/kazoo#715 is unmerged) or ``multiRead``
(:mod:`celery_zk.zk.reads`), nor hand the events of a
persistent watch to anyone: its connection drops an event no one of its own
watchers asked for. :mod:`celery_zk.zk.watches` and :mod:`celery_zk.zk.reads`
therefore need three private names, all here:

* ``KazooClient._call(request, async_result)``: queue a request kazoo has no
  method for (Zuul sends ``addWatch`` the same way);
* ``ConnectionHandler._read_watch_event(buffer, offset)``: wrapped, so the
  events of our watches are read before kazoo looks for its own watchers;
* ``KazooClient._data_watchers`` / ``_child_watchers``: whether kazoo has a
  watcher of its own on the event's path (then it gets the event too).

Fallback: without them :class:`~celery_zk.zk.watches.TreeWatches` reports
persistent watches unsupported, and consumers use one-shot child watches
(one more request per idle delivery) and one ``get`` per body (no
``multiRead``), as with a server older than 3.6.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import Watch

from . import PrivateAPIChanged, describe

__all__ = ["intercept_watch_events", "missing", "send"]

_USE = "to send addWatch/removeWatches and read persistent watch events"
_FALLBACK = "Persistent watches are off; consumers use one-shot child watches."

#: Every private name this module touches: where it lives, and the attribute.
PRIVATE: tuple[tuple[type, str], ...] = (
    (KazooClient, "_call"),
    (ConnectionHandler, "_read_watch_event"),
)
#: Set in ``KazooClient.__init__``: checked on an instance.
PRIVATE_INSTANCE = ("_connection", "_data_watchers", "_child_watchers")


def _changed(name: str) -> PrivateAPIChanged:
    return PrivateAPIChanged(describe("kazoo", name, _USE, _FALLBACK))


def missing(client: KazooClient | None = None) -> list[str]:
    """What the installed kazoo lacks of :data:`PRIVATE` (with ``client``, of
    :data:`PRIVATE_INSTANCE` too), one message each; empty when all is there."""
    problems = [str(_changed(f"{owner.__name__}.{name}"))
                for owner, name in PRIVATE if not callable(getattr(owner, name, None))]
    if client is not None:
        problems += [str(_changed(f"KazooClient().{name}"))
                     for name in PRIVATE_INSTANCE if not hasattr(client, name)]
    return problems


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
    data_watchers = getattr(client, "_data_watchers", None)
    child_watchers = getattr(client, "_child_watchers", None)
    if data_watchers is None or child_watchers is None:
        raise _changed("KazooClient._data_watchers/_child_watchers")

    def read_watch_event(buffer: bytes, offset: int) -> Any:
        watch, _ = Watch.deserialize(buffer, offset)
        taken = ours(watch.type, client.unchroot(watch.path))
        # kazoo replaces these dicts on a session change: read them each time.
        if (not taken or watch.path in client._data_watchers
                or watch.path in client._child_watchers):
            return original(buffer, offset)   # kazoo's own watchers
        return None

    connection._read_watch_event = read_watch_event  # type: ignore[union-attr]
