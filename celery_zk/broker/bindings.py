"""Exchanges and bindings shared by every process through ZooKeeper.

A binding is a node whose *name* holds the queue and routing key, so an
exchange's routing table is one ``get_children``, cached until a watch
drops it. A fanout publish, and a direct lookup that finds nothing, read it
afresh: a binding made an instant ago by another process is never missed.
Watch callbacks run on kazoo's thread: never block.
See ``docs/design.md``, "Routing".
"""
from __future__ import annotations

import functools
import json
import logging
from typing import Any, Callable

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NoNodeError

from ..zk.client import children, delete_if_there, json_object
from ..zk.layout import Layout
from ..zk.names import parse_binding_name, unescape
from ..zk.session import AfterExpiry, ClientHandle, weak_callback
from ..zk.tree import delete_tree

logger = logging.getLogger(__name__)


class Bindings:
    """Exchange declarations and routing tables stored under ``exchanges/``."""

    def __init__(self, handle: ClientHandle, layout: Layout,
                 wake: Callable[[], None]) -> None:
        self.handle = handle
        self.layout = layout
        self._wake = wake
        self._reclaiming: Any = None   # the session we asked to wake us (see bind)
        self._tables: dict[str, list[tuple[str, str]]] = {}
        self._types: dict[str, str] = {}
        self._watchers: dict[str, Callable[[Any], None]] = {}
        self._ephemeral: set[str] = set()   # paths of the ephemeral bindings we hold
        handle.add_listener(self._on_state)
        #: Call from any thread but kazoo's: re-creates ephemeral bindings after an expiry.
        self.restore_ephemeral = AfterExpiry(handle, self._recreate)

    @property
    def client(self) -> KazooClient:
        return self.handle.client

    def declare_exchange(self, exchange: str, type: str) -> None:
        client = self.client
        meta = json.dumps({"type": type}).encode()
        # Read first (ensure_path looks first too): every worker that starts
        # declares exchanges made long ago, and a write (or a refused create) is
        # a synced transaction.
        try:
            declared, _ = client.retry(client.get, self.layout.exchange(exchange))
        except NoNodeError:
            declared = None
        if declared != meta:   # its bindings/ is made before its type is set
            client.retry(client.ensure_path, self.layout.bindings(exchange))
            try:
                client.retry(client.set, self.layout.exchange(exchange), meta)
            except NoNodeError:  # deleted meanwhile: recreate
                client.retry(client.ensure_path, self.layout.bindings(exchange))
                client.retry(client.set, self.layout.exchange(exchange), meta)
        self._types[exchange] = type

    def exchange_type(self, exchange: str) -> str | None:
        """The declared type, read from ZooKeeper for exchanges this process never declared."""
        if exchange in self._types:
            return self._types[exchange]
        client = self.client
        try:
            data, _ = client.retry(client.get, self.layout.exchange(exchange))
        except NoNodeError:
            return None
        type_ = json_object(data).get("type")
        if type_:
            self._types[exchange] = type_
        return type_

    def delete_exchange(self, exchange: str) -> None:
        delete_tree(self.client, self.layout.exchange(exchange))
        self._types.pop(exchange, None)
        self._tables.pop(exchange, None)

    def bind(self, exchange: str, queue: str, routing_key: str, ephemeral: bool) -> None:
        self.restore_ephemeral()
        client = self.client
        path = self.layout.binding(exchange, queue, routing_key)
        if ephemeral:
            self.handle.hold(path)   # counted: another connection may hold it too
            self._ephemeral.add(path)
            session = self.handle.session
            if self._reclaiming is not session:   # another session's node: see reclaim
                self._reclaiming = session
                # Weakly: a session outlives the connections it served.
                session.held.on_reclaim_needed(weak_callback(self._wake))
        else:   # idempotent (looks first): another process may have bound it too
            client.retry(client.ensure_path, path)
        self._tables.pop(exchange, None)

    def unbind(self, exchange: str, queue: str, routing_key: str) -> None:
        path = self.layout.binding(exchange, queue, routing_key)
        if path in self._ephemeral:
            self._ephemeral.discard(path)
            self.handle.release_held(path)   # deleted when no other connection holds it
        else:
            client = self.client
            delete_if_there(client, path)
        self._tables.pop(exchange, None)

    def table(self, exchange: str, fresh: bool = False) -> list[tuple[str, str]]:
        """``[(routing key, queue), ...]`` bound to ``exchange``."""
        self.restore_ephemeral()
        if not fresh:
            cached = self._tables.get(exchange)
            if cached is not None:
                return cached
        client = self.client
        watcher = self._watchers.setdefault(
            exchange, functools.partial(weak_callback(self._invalidate), exchange))
        try:
            names = client.retry(client.get_children, self.layout.bindings(exchange),
                                 watch=watcher)
        except NoNodeError:
            names = []
        table = [(rk, queue) for queue, rk in filter(None, map(parse_binding_name, names))]
        self._tables[exchange] = table
        return table

    def bindings_of_queue(self, queue: str) -> list[tuple[str, str]]:
        """``[(exchange, routing key), ...]`` of one queue, across all exchanges."""
        client = self.client
        found = []
        for escaped in children(client, self.layout.exchanges):
            exchange = unescape(escaped)
            found += [(exchange, rk) for rk, q in self.table(exchange, fresh=True) if q == queue]
        return found

    def _invalidate(self, exchange: str, event: Any) -> None:  # kazoo's thread: no blocking
        self._tables.pop(exchange, None)

    def _on_state(self, state: KazooState) -> None:
        if state == KazooState.LOST:
            self._tables.clear()  # watches died with the session

    def reclaim(self) -> bool:
        """Make again the ephemeral bindings we hold that another session had
        made and that went with it (a worker restarted under the same name
        within its old session's timeout): from the drain loop, a no-op unless
        one went. Without this such a worker heard no broadcast (revokes,
        ``celery inspect``) once its old session expired. True when one was
        made again: what was broadcast while it was gone never came."""
        self.restore_ephemeral()
        return self._reclaiming is not None and bool(self._reclaiming.held.reclaim())

    def _recreate(self, client: KazooClient) -> None:
        for path in list(self._ephemeral):
            session = self.handle.session
            session.held.remake(session.client, path)
        if self._ephemeral:
            logger.info("celery_zk: re-created %d ephemeral binding(s) after session expiry",
                        len(self._ephemeral))
