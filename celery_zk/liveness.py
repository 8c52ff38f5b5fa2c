"""Owner liveness: one ephemeral node per consuming session, and recovery.

A consumer registers ``consumers/{id}-{seq}`` (ephemeral, sequential) before
it claims anything, so every owned message names a session that was alive when
it was claimed. When a session ends (crash, SIGKILL, partition past the
session timeout) ZooKeeper deletes its node; the children watch fires on every
survivor, and the one with the lowest sequence (the leader, an election that
needs no extra nodes) moves the dead owner's messages back to unowned. Each
move deletes the owned node in the same transaction that recreates the
unowned one, so two survivors racing can never requeue a message twice.
The leader then runs its other duties (``leader_duties``: the transport's
sweep of auto-delete queues nobody holds any more).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence

from kazoo.client import KazooState
from kazoo.exceptions import NoNodeError
from kazoo.recipe.watchers import ChildrenWatch

from .client import ClientHandle, create_once, log_failure
from .layout import Layout, consumer_prefix, parse_consumer_name, split_owned_name
from .queue import QueueStore

logger = logging.getLogger(__name__)


class ConsumerSession:
    """This connection's identity as a consumer, and its share of recovery duty."""

    def __init__(self, handle: ClientHandle, layout: Layout, store: QueueStore,
                 leader_duties: Sequence[Callable[[], object]] = ()) -> None:
        self.handle = handle
        self.leader_duties = list(leader_duties)  # run by the leader after each recovery
        self.layout = layout
        self.store = store
        self.consumer_id: str | None = None
        self.node_path: str | None = None
        self._valid = False
        self._pid = 0
        self._lock = threading.Lock()
        self._live: list[str] = []
        self._nodes: dict[str, str] = {}  # every consumer id this process registered
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        handle.add_listener(self._on_state)

    # -- identity -------------------------------------------------------------------
    def ensure_registered(self) -> tuple[str, str]:
        """``(consumer id, node path)`` of a live registration, registering if needed."""
        if self._valid and self._pid == os.getpid():
            assert self.consumer_id and self.node_path
            return self.consumer_id, self.node_path
        with self._lock:
            if not (self._valid and self._pid == os.getpid()):
                if self._pid != os.getpid():  # forked: nothing of the parent's is ours
                    self._thread, self._live = None, []
                self._register()
                self._pid = os.getpid()
                self._valid = True
                self._start_watching()
            assert self.consumer_id and self.node_path
            return self.consumer_id, self.node_path

    def _register(self) -> None:
        client = self.handle.client
        consumer_id = "c" + uuid.uuid4().hex[:12]
        data = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
        client.retry(client.ensure_path, self.layout.consumers)

        def find() -> str | None:  # a lost reply may hide a node we already made
            for name in client.get_children(self.layout.consumers):
                parsed = parse_consumer_name(name)
                if parsed and parsed[0] == consumer_id:
                    return self.layout.consumer(name)
            return None

        self.node_path = create_once(
            client, lambda: client.create(self.layout.consumer(consumer_prefix(consumer_id)),
                                          data, ephemeral=True, sequence=True), find)
        self.consumer_id = consumer_id
        self._nodes[consumer_id] = self.node_path
        logger.debug("celery_zk: registered consumer %s", self.node_path)

    def node_of(self, consumer_id: str) -> str:
        """The session node of a consumer id this process used, current or past.

        An ack is guarded by the node of the session that *claimed* the
        message; after an expiry that node is gone and the ack is refused.
        """
        node = self._nodes.get(consumer_id)
        if node is None:
            node = self.layout.consumer(consumer_prefix(consumer_id) + "unknown")
        return node

    def _on_state(self, state: KazooState) -> None:
        # kazoo's event thread: flag and wake, never block.
        if state == KazooState.LOST:
            self._valid = False
        self._wake.set()

    # -- recovery -----------------------------------------------------------------
    def _start_watching(self) -> None:
        if self._thread is not None:
            return
        ChildrenWatch(self.handle.client, self.layout.consumers, self._on_consumers)
        self._thread = threading.Thread(target=self._run, name="celery_zk-recovery",
                                        daemon=True)
        self._thread.start()

    def _on_consumers(self, children: list[str]) -> bool | None:
        if self._stopped:
            return False  # stops the ChildrenWatch
        self._live = children
        self._wake.set()
        return None

    def live_ids(self) -> list[str]:
        """Live consumer ids, oldest session first (as last seen by the watch)."""
        live = sorted((p for p in map(parse_consumer_name, self._live) if p),
                      key=lambda p: p[1])
        return [consumer_id for consumer_id, _ in live]

    def is_leader(self) -> bool:
        ids = self.live_ids()
        return bool(ids) and ids[0] == self.consumer_id

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            if self._stopped:
                break
            try:
                self.ensure_registered()
                if self.is_leader():
                    self.recover_dead_owners()
                    for duty in self.leader_duties:
                        duty()
            except Exception as exc:  # keep the thread alive; retried below
                log_failure(logger, exc, "celery_zk: recovery pass failed; will retry in 1 s",
                            level=logging.ERROR)
                self._wake.wait(1.0)
                self._wake.set()

    def recover_dead_owners(self) -> int:
        """Requeue every owned message whose owner has no live session. Returns count."""
        client = self.handle.client
        try:
            children = client.retry(client.get_children, self.layout.consumers)
        except NoNodeError:
            children = []
        live = {p[0] for p in map(parse_consumer_name, children) if p}
        moved = 0
        for queue in self.store.queue_names():
            for name in self.store.owned_listing(queue):
                owner = split_owned_name(name)
                if owner is None or owner[0] in live:
                    continue
                if self.store.requeue(self.layout.owned_message(queue, name)):
                    moved += 1
        if moved:
            logger.warning("celery_zk: requeued %d message(s) of consumers whose "
                           "ZooKeeper session ended", moved)
        return moved

    def close(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._valid and self.node_path and self._pid == os.getpid() and self.handle.started:
            try:
                self.handle.client.delete(self.node_path)
            except Exception:  # the session's end removes it anyway
                logger.debug("celery_zk: could not delete %s", self.node_path, exc_info=True)
        self._valid = False
