"""One consumer's membership of one queue: joining, its credit, leaving.

A consumer registers a node under the queue's ``consumers/`` (ephemeral,
sequential; its data says the consumer's credit), and the queue's dispatcher
(:mod:`celery_zk.broker.dispatcher`) gives work into its inbox from then
on. Leaving deletes that node first (the dispatcher gives nothing after
it), then gives back every entry of the inbox not handed to kombu, each to
its place in the queue; a give-back that cannot reach ZooKeeper is redone in
the background (if the session ends first, recovery gives them back).
"""
from __future__ import annotations

import json
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from kazoo.exceptions import NodeExistsError, NoNodeError, NotEmptyError

from ..features import affinity
from ..zk.client import (
    CONNECTION_ERRORS,
    RedoThread,
    create_once,
    delete_if_there,
    log_failure,
    unwaited,
)
from ..zk.message_names import slot_of
from .dispatcher import Dispatcher

if TYPE_CHECKING:   # the protocol's module imports nothing of ours that imports this one
    from .connection import ZKConnection

__all__ = ["Membership"]

logger = logging.getLogger(__name__)


class Membership:
    """One connection's consumer of one queue, as the queue sees it."""

    def __init__(self, transport: ZKConnection, queue: str) -> None:
        self.transport = transport
        self.queue = queue
        self.node: str | None = None   # our node under the queue's consumers/
        self.credit = 0                # what the node says
        # The queue's dispatcher, looked up on every turn of the consuming loop,
        # so kept (for a session).
        self._duty: tuple[Any, Dispatcher | None] = (None, None)

    def dispatcher(self) -> Dispatcher:
        transport = self.transport
        session = transport.handle.session
        cached_for, dispatcher = self._duty
        if cached_for is not session or dispatcher is None:
            dispatcher = Dispatcher.of(session, transport.layout, transport.settings.options,
                                       self.queue)
            self._duty = (session, dispatcher)
        return dispatcher

    def make_inbox(self, consumer_id: str) -> bool:
        """Made after our consumer node (see Recovery.recover_dead_owners); False
        when the queue does not exist."""
        client = self.transport.handle.client
        try:
            client.retry(client.create, self.transport.layout.inbox(self.queue, consumer_id))
        except NodeExistsError:
            pass
        except NoNodeError:
            return False
        return True

    def join(self, consumer_id: str) -> None:
        """Register under the queue's consumers/ with our credit; the dispatcher
        gives us work from then on."""
        transport = self.transport
        client = transport.handle.client
        path = transport.layout.new_queue_consumer(self.queue, consumer_id)
        parent = transport.layout.queue_consumers(self.queue)

        def find() -> str | None:   # a create whose reply was lost: ours, by our id
            names = client.get_children(parent)
            prefix = path.rpartition("/")[2]
            return next((f"{parent}/{n}" for n in names if n.startswith(prefix)), None)

        try:
            node = create_once(client, lambda: client.create(path, self._data(),
                                                             ephemeral=True, sequence=True),
                               find)
        except NoNodeError:
            return   # no queue (deleted meanwhile): the next look, once declared again
        transport.handle.own(node)   # deleted when this connection goes, however
        self.node = node
        self.dispatcher().join(consumer_id, transport.wake)

    def _data(self) -> bytes:
        return json.dumps({"credit": self.credit, "worker": affinity.WORKER,
                           "host": socket.gethostname(), "pid": os.getpid()}).encode()

    def write_credit(self, credit: int) -> None:
        """Written without waiting: it changes rarely (Celery raises the prefetch
        for ETA tasks, autoscaling changes it, the lookahead starts or ends)."""
        if credit == self.credit:
            return
        self.credit = credit
        if self.node is None or not self.transport.handle.started:
            return
        # A node gone with the session is written again by registering.
        unwaited(self.transport.handle.client.set_async(self.node, self._data()), logger,
                 "celery_zk: could not update %s", self.node, expected=(NoNodeError,))

    def leave(self, consumer_id: str | None, handed: set[str], keep: set[str]) -> None:
        """Stop being given work, and give back the inbox's entries but those
        ``handed`` to kombu (acked, or the channel's to settle); the inbox goes
        too unless ``keep`` (delivered and not settled) still has entries in it."""
        node, self.node = self.node, None
        if consumer_id is None:
            return
        self.dispatcher().leave(consumer_id)
        if not self.transport.handle.started:
            return
        try:
            self._give_back(consumer_id, node, handed, keep)
        except CONNECTION_ERRORS as exc:
            # A session that lives on would keep them: give them back once
            # ZooKeeper answers (if it ends first, recovery does).
            log_failure(logger, exc, "celery_zk: could not give back the undelivered "
                        "messages of %s now; retrying in the background", self.queue)
            _give_backs.submit((self, consumer_id, node, handed, keep))

    def _give_back(self, consumer_id: str, node: str | None, handed: set[str],
                   keep: set[str]) -> None:
        transport = self.transport
        client, layout = transport.handle.client, transport.layout
        if node is not None:
            delete_if_there(client, node)
            transport.handle.disown(node)
        inbox = layout.inbox(self.queue, consumer_id)
        try:
            names = client.retry(client.get_children, inbox)
        except NoNodeError:
            return
        transport.acks.requeue_many([layout.inbox_message(self.queue, consumer_id, name)
                                     for name in names if name not in handed and name not in keep
                                     and slot_of(name) is None])   # running: kept
        if not keep:
            # Refused while a delivered message waits for its ack
            delete_if_there(client, inbox, also=(NotEmptyError,))


def _give_back_again(item: tuple[Membership, str, str | None, set[str], set[str]]) -> None:
    membership, consumer_id, node, handed, keep = item
    try:
        membership._give_back(consumer_id, node, handed, keep)
    except Exception as exc:   # the session's end gives them back (recovery)
        log_failure(logger, exc, "celery_zk: could not give back the undelivered messages "
                    "of %s; they go back when this worker's session ends", membership.queue)


#: Give-backs that could not reach ZooKeeper, redone in order once it answers.
_give_backs: RedoThread[tuple[Membership, str, str | None, set[str], set[str]]] = RedoThread(
    "celery_zk-give-back", _give_back_again)
