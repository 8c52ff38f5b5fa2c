"""The kombu channel's QoS: acks and rejects are ZooKeeper transactions on
the owned node; an early ack of a concurrency-limited task that still runs
keeps its slot (:mod:`celery_zk.broker.slots`)."""
from __future__ import annotations

import logging
from typing import Any

from kombu.transport import virtual

from ..compat import kombu as kombu_compat
from .slots import SLOTS

__all__ = ["QoS"]

logger = logging.getLogger(__name__)


class QoS(virtual.QoS):
    """Acks and rejects are ZooKeeper transactions on the owned node."""

    def __init__(self, channel: Any, prefetch_count: int = 0) -> None:
        super().__init__(channel, prefetch_count)
        # kombu registers an exit hook that holds this QoS, and through it the
        # channel and the transport, until the interpreter exits: a Connection
        # dropped without close() could never be collected. A channel that is
        # closed requeues its unacked messages itself; one that is dropped has
        # them requeued by recovery once its consumer node goes with its lease.
        kombu_compat.forget_at_exit(self)

    def _closed(self, delivery_tag: str, what: str) -> bool:
        """True when the channel is closed (e.g. celery restarted its consumer after
        a connection loss): closing requeued every unacked message, this one too."""
        if self.channel.connection is not None:
            return False
        logger.warning("celery_zk: not %s %s: its channel was closed, which requeued "
                       "the message; it will run again (at-least-once).", what, delivery_tag)
        return True

    def unacked(self) -> int:
        """Messages delivered and not yet acked or rejected."""
        return kombu_compat.unacked(self)

    def ack(self, delivery_tag: str) -> None:
        if self._closed(delivery_tag, "acking"):
            return
        transport = self.channel.connection
        owner = transport.session.node_of(transport.layout.split_owned_path(delivery_tag)[1])
        if not SLOTS.ack(transport, delivery_tag, owner):   # a running limited task's slot
            transport.acks.ack_async(delivery_tag, owner)
        transport.settled(delivery_tag)
        super().ack(delivery_tag)
        transport.wake()  # a prefetch slot is free

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if self._closed(delivery_tag, "rejecting"):
            return
        if requeue:
            self.channel.connection.acks.requeue(delivery_tag)
        else:
            self.channel.connection.acks.remove(
                delivery_tag, dead_letter=self.channel.options.dead_letter_rejected,
                reason="rejected with requeue=False")
        kombu_compat.settle(self, delivery_tag)
        self.channel.connection.settled(delivery_tag)
        self.channel.connection.wake()

    def restore_unacked(self) -> list[tuple[BaseException, Any]]:
        """Put every unacked message back (warm shutdown, channel close)."""
        errors: list[tuple[BaseException, Any]] = []
        for tag, message, settled in kombu_compat.drain_delivered(self):
            try:
                self.channel.connection.acks.requeue(tag)
            except BaseException as exc:
                if not settled:
                    errors.append((exc, message))
            finally:
                self.channel.connection.settled(tag)
        return errors
