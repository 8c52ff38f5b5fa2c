"""Owner liveness: one ephemeral node per consuming connection, and recovery
of the messages of owners that are gone.

A consumer registers before anything is given to it, so every owned message
names an owner that was alive when it was given. Recovery is one duty per
process and root, led by the process of the oldest live consumer; each
requeue deletes the owned node in the multi that puts the name back, so two
survivors racing never requeue a message twice.
See ``docs/design.md``, "Owner liveness and recovery".
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import weakref
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NoNodeError, NotEmptyError
from kazoo.recipe.watchers import ChildrenWatch

from ..zk.client import (
    answered,
    children,
    create_once,
    delete_if_there,
    json_object,
    log_failure,
    unwaited,
)
from ..zk.config import ZKOptions
from ..zk.layout import Layout
from ..zk.message_names import parse_message_name, slot_of
from ..zk.names import new_consumer_id, parse_consumer_name
from ..zk.session import ClientHandle, SharedSession, weak_callback
from .acks import Acks
from .autodelete import Sweeper
from .queues import Queues

logger = logging.getLogger(__name__)

#: Every consuming connection's identity in this process (see delivered_under).
_identities: weakref.WeakSet[ConsumerSession] = weakref.WeakSet()
_identities_lock = threading.Lock()   # a connection made while a pool thread looks


def delivered_under(delivery_tag: str) -> tuple[bool, int | None]:
    """Whether ``delivery_tag`` names a message in a consumer's inbox, and the
    session (its id) of the live registration of this process it was given to;
    None when that registration ended (its session was lost, its connection
    closed): the message went back to its queue."""
    ours = False
    with _identities_lock:
        identities = list(_identities)
    for identity in identities:
        try:
            owner = identity.layout.split_owned_path(delivery_tag)[1]
        except ValueError:
            continue
        ours = True
        if identity._valid and owner == identity.consumer_id:
            return True, identity.session_id
    return ours, None


class ConsumerSession:
    """One connection's identity as a consumer."""

    def __init__(self, handle: ClientHandle, layout: Layout) -> None:
        self.handle = handle
        self.layout = layout
        self.consumer_id: str | None = None
        self.node_path: str | None = None
        #: The ZooKeeper session the registration was made in.
        self.session_id: int | None = None
        self._valid = False
        self._pid = 0
        self._lock = threading.Lock()
        self._nodes: dict[str, str] = {}  # every consumer id this connection registered
        self._recovery: Recovery | None = None
        self._queues: frozenset[str] = frozenset()
        handle.add_listener(self._on_state)
        with _identities_lock:
            _identities.add(self)

    # -- identity -------------------------------------------------------------------
    def ensure_registered(self) -> tuple[str, str]:
        """``(consumer id, node path)`` of a live registration, registering if needed."""
        if self._valid and self._pid == os.getpid():
            assert self.consumer_id and self.node_path
            return self.consumer_id, self.node_path
        with self._lock:
            if not (self._valid and self._pid == os.getpid()):
                if self._pid != os.getpid():  # forked: nothing of the parent's is ours
                    self._nodes = {}
                self._register()
                self._pid = os.getpid()
                self._valid = True
                self._recovery = Recovery.of(self.handle.session, self.layout,
                                             self.handle.settings.options)
                self._recovery.join(self)
            assert self.consumer_id and self.node_path
            return self.consumer_id, self.node_path

    def _register(self) -> None:
        client = self.handle.client
        consumer_id = new_consumer_id()
        data = self._data()
        client.retry(client.ensure_path, self.layout.consumers)
        path = self.layout.consumer(consumer_id)
        # Not sequential: the id is unique and sorts by age (see new_consumer_id).
        create_once(client, lambda: client.create(path, data, ephemeral=True),
                    lambda: path if client.exists(path) else None)
        self.node_path = path
        self.handle.own(self.node_path)   # deleted when this connection goes, however
        self.session_id = client.client_id[0] if client.client_id else None
        self.consumer_id = consumer_id
        self._nodes[consumer_id] = self.node_path
        logger.debug("celery_zk: registered consumer %s", self.node_path)

    def _data(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "queues": sorted(self._queues)}).encode()

    def set_queues(self, queues: set[str]) -> None:
        """The queues this connection consumes, kept in its node's data for
        operators (``celery zk status``) and ``queue_declare``'s consumer count.
        Sent without waiting: it changes only when consumers start or stop."""
        if frozenset(queues) == self._queues:
            return
        self._queues = frozenset(queues)
        if not (self._valid and self.node_path and self._pid == os.getpid()
                and self.handle.started):
            return   # registering writes it
        # NoNode: re-registered (an expiry) with the new data already.
        unwaited(self.handle.client.set_async(self.node_path, self._data()), logger,
                 "celery_zk: could not update %s", self.node_path, expected=(NoNodeError,))

    @property
    def registered(self) -> bool:
        """Registered at some point (and not closed): re-register after an expiry."""
        return self.consumer_id is not None and self._pid == os.getpid()

    def node_of(self, consumer_id: str) -> str:
        """The session node of a consumer id this connection used, current or past.

        An ack is guarded by the node of the registration that *claimed* the
        message; after an expiry that node is gone and the ack is refused.
        """
        node = self._nodes.get(consumer_id)
        if node is None:   # a path no consumer has: the ack is refused
            node = self.layout.consumer(consumer_id + "~unknown")
        return node

    def _on_state(self, state: KazooState) -> None:
        # kazoo's event thread: flag only, never block.
        if state == KazooState.LOST:
            self._valid = False

    def live_ids(self) -> list[str]:
        """Live consumer ids, oldest registration first (as last seen by the watch)."""
        recovery = self._recovery
        return recovery.live_ids() if recovery is not None else []

    def close(self) -> None:
        recovery, self._recovery = self._recovery, None
        if recovery is not None:
            recovery.leave(self)
        if self._valid and self.node_path and self._pid == os.getpid() and self.handle.started:
            try:
                self.handle.client.delete(self.node_path)
            except Exception:  # releasing the lease (or the session's end) removes it
                logger.debug("celery_zk: could not delete %s", self.node_path, exc_info=True)
            else:
                self.handle.disown(self.node_path)
        self._valid = False
        self.consumer_id = None


class Recovery:
    """This process's share of recovery duty under one root, on one session."""

    def __init__(self, session: SharedSession, layout: Layout, options: ZKOptions) -> None:
        self.session = session
        self.layout = layout
        self.queues = Queues(session, layout, options)
        self.acks = Acks(self.queues)
        self.sweeper = Sweeper(layout, self.queues)
        self._members: weakref.WeakSet[ConsumerSession] = weakref.WeakSet()
        self._live: list[str] = []
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        session.on_close(self.stop)

    @classmethod
    def of(cls, session: SharedSession, layout: Layout, options: ZKOptions) -> Recovery:
        """The one recovery of ``session`` under ``layout``'s root."""
        return session.singleton(("recovery", layout.root),
                                 lambda: cls(session, layout, options))

    def join(self, member: ConsumerSession) -> None:
        with self._lock:
            self._members.add(member)
            if self._thread is None:
                ChildrenWatch(self.session.client, self.layout.consumers,
                              weak_callback(self._on_consumers, dead=False))
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="celery_zk-recovery")
                self._thread.start()
        self._wake.set()   # the new member may be the leader now

    def leave(self, member: ConsumerSession) -> None:
        self._members.discard(member)

    def _on_consumers(self, children: list[str]) -> bool | None:
        if self._stopped:
            return False  # stops the ChildrenWatch
        self._live = children
        self._wake.set()
        return None

    def live_ids(self) -> list[str]:
        """Live consumer ids, oldest registration first (as last seen by the watch)."""
        return sorted(p for p in map(parse_consumer_name, self._live) if p)

    def is_leader(self) -> bool:
        ids = self.live_ids()
        return bool(ids) and self._ours(ids[0])

    def _ours(self, consumer_id: str) -> bool:
        return any(m.consumer_id == consumer_id for m in list(self._members))

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            if self._stopped:
                break
            try:
                self._pass()
            except Exception as exc:  # keep the thread alive; retried below
                log_failure(logger, exc, "celery_zk: recovery pass failed; will retry in 1 s",
                            level=logging.ERROR)
                self._wake.wait(1.0)
                self._wake.set()

    def _pass(self) -> None:
        # A method of its own: its locals (members) must not outlive the pass in
        # the thread's frame, or a dropped connection could not be collected.
        for member in list(self._members):
            if member.registered:
                member.ensure_registered()   # again, after a session expiry
        if self.is_leader():
            self.recover_dead_owners()
            self.sweeper.sweep()

    def recover_dead_owners(self) -> int:
        """Requeue every owned message whose owner has no live session. Returns count.

        Every queue's ``owned/`` is listed before the live consumers are: an
        inbox is made after its consumer's node, so an inbox whose consumer
        is missing from the later listing is truly a dead one's.
        """
        client, layout = self.session.client, self.layout
        owned = [(queue, self.queues.owned_listing(queue)) for queue in self.queues.queue_names()]
        live = {p for p in map(parse_consumer_name, children(client, layout.consumers)) if p}
        moved = 0
        for queue, names in owned:
            for name in names:
                if parse_consumer_name(name) == name and name not in live:
                    moved += self._empty_inbox(queue, name)
        if moved:
            logger.warning("celery_zk: requeued %d message(s) of consumers whose "
                           "ZooKeeper session ended", moved)
        return moved

    def _empty_inbox(self, queue: str, consumer_id: str) -> int:
        """Requeue a dead consumer's inbox, each message to its place, then delete it."""
        client, layout = self.session.client, self.layout
        inbox = layout.inbox(queue, consumer_id)
        try:
            names = client.retry(client.get_children, inbox)
        except NoNodeError:
            return 0
        moved = self.acks.requeue_many([layout.inbox_message(queue, consumer_id, name)
                                        for name in names
                                        if parse_message_name(name) is not None])
        # Its running tasks' slots: they ran or died with it (broker.slots).
        self.acks.queues.delete_all([layout.inbox_message(queue, consumer_id, name)
                                     for name in names if slot_of(name) is not None])
        # Gone already; or refilled, which a dead owner's inbox cannot be
        delete_if_there(client, inbox, also=(NotEmptyError,))
        return moved

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()


def consumer_nodes(client: KazooClient, layout: Layout) -> list[tuple[str, dict[str, Any], float]]:
    """``(consumer id, node data, registered at)`` of every live consumer, oldest
    first; the data as :meth:`ConsumerSession._data` wrote it (``{"host", "pid",
    "queues"}``), ``{}`` if unreadable."""
    names = [n for n in children(client, layout.consumers) if parse_consumer_name(n)]
    replies = [(name, client.get_async(layout.consumer(name))) for name in names]
    found = []
    for name, (data, stat) in answered(replies):   # one gone meanwhile: left out
        found.append((parse_consumer_name(name) or name, json_object(data),
                      stat.ctime / 1000))
    return sorted(found, key=lambda consumer: consumer[2])


def consumer_count(client: KazooClient, layout: Layout, queue: str) -> int:
    """Live consumers whose node says they consume ``queue``."""
    return sum(1 for _, meta, _ in consumer_nodes(client, layout)
               if queue in meta.get("queues", ()))

