"""Ephemeral nodes several users of one session need, counted and kept.

The binding of a reply queue two connections of a process consume is one
node for both: each connection's lease holds a count on it, and the last
one out deletes it (:meth:`HeldNodes.release`). Such a node may also exist
already as another session's: a process killed a moment ago, whose session
lives until its timeout, made it under the same name. It goes with that
session, and ours must be there then: it is watched, and made again by
:meth:`HeldNodes.reclaim` once it is gone (from the owner's thread: a watch
callback only flags and wakes). A dropped connection drops every watch with
it (the server's and kazoo's alike; kazoo sends no SetWatches), so each
borrowed node is looked at again once connected.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NodeExistsError

from .client import CONNECTION_ERRORS, delete_if_there

__all__ = ["HeldNodes"]

logger = logging.getLogger(__name__)


class HeldNodes:
    """One session's counted ephemeral nodes (see the module docstring)."""

    def __init__(self, client: Callable[[], KazooClient | None],
                 weak: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        #: The session's client, if it has one (never makes one).
        self._client = client
        self._lock = threading.Lock()
        self._held: dict[str, set[str]] = {}   # shared ephemeral path -> lease tokens
        self._borrowed: set[str] = set()   # held paths another session made (watched)
        self._lost: set[str] = set()       # of those, gone: to make again (reclaim)
        self._wakers: list[Callable[[], None]] = []
        self._gone_cb = weak(self._on_gone)

    def hold(self, client: KazooClient, token: str, path: str) -> None:
        """Create ephemeral ``path`` (if missing) and count ``token`` as a holder."""
        with self._lock:   # against a last release deleting it meanwhile
            self._make(client, path)
            self._held.setdefault(path, set()).add(token)

    def _make(self, client: KazooClient, path: str) -> bool:
        """Make ``path`` ours, or watch another session's node of that name;
        True when this call created it."""
        try:
            client.retry(client.create, path, ephemeral=True, makepath=True)
            return True
        except NodeExistsError:
            pass
        # Marked before the watch is set: the deletion may be reported before
        # exists() returns here.
        self._borrowed.add(path)
        stat = client.retry(client.exists, path, watch=self._gone_cb)
        if stat is None:
            self._borrowed.discard(path)
            return self._make(client, path)   # gone meanwhile
        if stat.ephemeralOwner == client.client_id[0]:
            self._borrowed.discard(path)   # ours already (a retried create)
        return False

    def _on_gone(self, event: Any) -> None:
        # kazoo's event thread: flag and wake, nothing else.
        if event.path is None:
            self._lost.update(list(self._borrowed))   # a dropped connection: look again
        elif event.path in self._borrowed:
            self._lost.add(event.path)   # deleted; any other event used the watch up
        else:
            return
        self.wake()

    def wake(self) -> None:
        """Wake those who reclaim (when connected again, after a loss)."""
        if self._lost:
            for wake in list(self._wakers):
                wake()

    def on_reclaim_needed(self, wake: Callable[[], None]) -> None:
        """``wake`` is called (kazoo's thread) when a held node another session
        had made is gone, or its watch was dropped with a connection: call
        :meth:`reclaim`."""
        self._wakers.append(wake)

    def remake(self, client: KazooClient, path: str) -> None:
        """Make a held node again (after a session expiry), watching it if
        another session has it."""
        with self._lock:
            self._make(client, path)

    def reclaim(self) -> list[str]:
        """Make again the held nodes whose other session ended, and watch again
        those whose watch went with a connection (from any thread but kazoo's;
        a no-op unless some need it, or while not connected: the client's
        reconnect wakes the caller again). The paths made again."""
        made: list[str] = []
        client = self._client()
        if not self._lost or client is None or client.state != KazooState.CONNECTED:
            return made
        with self._lock:
            while self._lost:
                path = self._lost.pop()
                self._borrowed.discard(path)
                if path not in self._held:
                    continue
                try:
                    created = self._make(client, path)
                except CONNECTION_ERRORS:
                    self._lost.add(path)   # the next call, once connected again
                    break
                if created:
                    made.append(path)
                    logger.info("celery_zk: made %s again: the session that had made it "
                                "ended", path)
        return made

    def release(self, token: str, path: str) -> None:
        """Drop ``token``'s count on ``path``; the last holder deletes it."""
        with self._lock:
            holders = self._held.get(path)
            if holders is None:
                return
            holders.discard(token)
            if holders:
                return
            del self._held[path]
            client = self._client()
            if client is None:
                return
            delete_if_there(client, path)
