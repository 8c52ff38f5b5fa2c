"""The kombu channel of ``zk://``: consuming, publishing, declaring and
routing, each a ZooKeeper operation (:mod:`celery_zk.broker.queues`), and the
QoS whose acks and rejects are transactions on the owned node.

The transport (:mod:`celery_zk.broker.transport`) owns the connection: the
session, the event loop and ``drain_events``. A channel sees it through
:class:`~celery_zk.broker.connection.ZKConnection`.
"""
from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from queue import Empty
from typing import Any

from kombu.serialization import loads
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments
from kombu.transport.virtual.base import queue_declare_ok_t

from ..compat import celery_pool
from ..compat import kombu as kombu_compat
from ..compat.kazoo import QuotaExceededError
from ..features.affinity import affinity_of
from ..features.limit_gate import RATE_LIMITED, rate_limited
from ..features.limits import limit_tokens
from ..features.revokes import RevokeStore, control_command
from ..zk.client import CONNECTION_ERRORS
from ..zk.message_names import parse_message_name
from ..zk.names import ONCE_PROPERTY
from . import budget, delayed, queue_arguments
from .connection import ZKConnection
from .liveness import consumer_count
from .qos import QoS
from .ready import Claimed

__all__ = ["Channel", "QoS", "encode_message"]

logger = logging.getLogger(__name__)


def encode_message(message: dict[str, Any]) -> bytes:
    """A kombu message as stored: JSON.

    A message property JSON cannot carry (``Producer.publish(..., **kwargs)``
    passes any keyword as a property; a ``before_task_publish`` handler that
    republishes with its ``**kwargs`` passes the signal itself) is dropped
    with a warning, as AMQP (py-amqp) drops properties it has no field for:
    the broker stores messages, not Python objects. Headers and the body are
    application data: those still fail, naming what could not be encoded.
    """
    try:
        return json.dumps(message).encode()
    except TypeError:
        properties = message.get("properties")
        if not isinstance(properties, dict):
            raise
    kept = {}
    for name, value in properties.items():
        try:
            json.dumps(value)
        except TypeError as exc:
            logger.warning("celery_zk: message property %r dropped: %s (only JSON values "
                           "can be stored, as AMQP stores only its own properties)", name, exc)
            continue
        kept[name] = value
    try:
        return json.dumps({**message, "properties": kept}).encode()
    except TypeError as exc:
        raise TypeError(f"celery_zk cannot store this message: {exc}. Message headers and "
                        "bodies must be JSON-encodable (the body is already serialized by "
                        "kombu; check the headers).") from exc


def body_size(message: dict[str, Any]) -> int:
    """The size of a message's body as the application sent it, which the size
    limit counts, as AMQP brokers do. kombu's virtual transports store the
    body base64-encoded (a third more): that is the stored size."""
    body = message.get("body", "")
    size = len(body)
    if message.get("properties", {}).get("body_encoding") == "base64" and isinstance(body, str):
        size = size * 3 // 4 - body[-2:].count("=")
    return size


class Channel(virtual.Channel):
    """A kombu channel whose queues live in ZooKeeper."""

    QoS = QoS
    supports_fanout = True
    do_restore = True
    connection: ZKConnection

    def __init__(self, connection: ZKConnection, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self.options = connection.settings.options
        self._consuming: set[str] = set()   # queues whose inbox this channel consumes
        self._no_ack_queues: set[str] = set()

    # -- consuming ----------------------------------------------------------------
    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        # Register before anything is given to us: an owned message must always
        # name a session.
        self.connection.session.ensure_registered()
        self.connection.prepare_worker()
        if no_ack:
            self._no_ack_queues.add(queue)
        result = super().basic_consume(queue, no_ack, *args, **kwargs)
        if queue not in self._consuming:
            self._consuming.add(queue)
            inbox = self.connection.inbox(queue)
            inbox.set_credit(self.qos.prefetch_count or 0)   # joins with it
            inbox.start()
        self.connection.consuming_changed()
        self.connection.wake()
        return result

    def basic_qos(self, *args: Any, **kwargs: Any) -> Any:
        result = super().basic_qos(*args, **kwargs)
        self.connection.wake()   # a raised prefetch limit frees slots
        return result

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = kombu_compat.queue_of(self, consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in kombu_compat.consumed_queues(self):
            self._stop_consuming(queue)
        if self.connection is not None:   # None once the channel is closed
            self.connection.consuming_changed()
        return result

    def _stop_consuming(self, queue: str) -> None:
        """Leave ``queue``'s inbox; the last channel out gives back what was given
        to it and not delivered."""
        if queue in self._consuming and self.connection is not None:
            self._consuming.discard(queue)
            try:
                self.connection.inbox(queue).stop()
            except CONNECTION_ERRORS:
                pass   # the session's end gives them back

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        transport = self.connection
        inbox = transport.inbox(queue)
        if queue not in self._consuming:
            claimed = inbox.get_one()   # basic_get
            if claimed is None:
                raise Empty()
            payload = self._decode(claimed)
            if payload is None:
                raise Empty()
            return payload
        inbox.set_credit(self.qos.prefetch_count or 0)
        no_ack = queue in self._no_ack_queues
        while True:
            # What a queue without acks (Celery's remote control) delivers takes
            # no pool slot: a busy worker keeps taking it, its offer standing.
            in_hand, slots = 0 if no_ack else self._in_hand(), celery_pool.pool_slots()
            inbox.look(in_hand, slots)
            claimed = inbox.take()
            if claimed is None:
                inbox.fill(in_hand, slots)
                claimed = inbox.take()
            if claimed is None:
                raise Empty()
            payload = self._decode(claimed)
            if payload is not None:
                if no_ack:
                    # No ack will come (event monitors): delivered means done.
                    transport.acks.discard(claimed.owned_path)
                    transport.settled(claimed.owned_path)
                return payload

    def deliver_no_ack_first(self, deliver: Callable[[Any, str], Any]) -> bool:
        """Deliver a message of a queue consumed without acks, if one is ready;
        True if one was. Such a message (a remote-control command, an event)
        goes before the tasks ready with it: a revoke broadcast just before a
        task is heard before that task runs, whichever queue kombu's round
        robin would have looked at first."""
        for queue in self._no_ack_queues & self._consuming:
            if not self.connection.inbox(queue).has_news:
                continue   # kombu's round robin looks there too: only the ready count
            try:
                message = self._get(queue)
            except Empty:
                continue
            deliver(message, queue)
            return True
        return False

    def _in_hand(self) -> int:
        """Messages delivered and not done with: unacked, or in a Celery worker
        of this process, its tasks received and not finished (Celery acks a
        task as it starts, unless acks_late)."""
        state = sys.modules.get("celery.worker.state")
        requests = len(state.reserved_requests) if state is not None else 0
        return max(self.qos.unacked(), requests)

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        message = super().basic_get(queue, no_ack, **kwargs)
        if message is not None and no_ack:
            self.connection.acks.discard(message.delivery_tag)
            self.connection.settled(message.delivery_tag)
        return message

    def _decode(self, claimed: Claimed) -> dict[str, Any] | None:
        try:
            payload = json.loads(claimed.data)
            properties = payload["properties"]
            properties["delivery_tag"] = claimed.owned_path
            # Start gates: the server answered since then (not when it is decoded:
            # a message may wait in the inbox, its lookahead, before delivery).
            properties[celery_pool.READ_AT] = claimed.read_at
            properties[RATE_LIMITED] = self._rate_limited()
            if self.connection.queue_limits.expired(claimed, properties):   # not delivered
                self.connection.settled(claimed.owned_path)
                return None
            parsed = parse_message_name(claimed.name)
            if parsed is not None and parsed.requeued:
                # The name says it was requeued (by a reject, a shutdown or a dead owner).
                payload["redelivered"] = True
                properties.setdefault("delivery_info", {})["redelivered"] = True
            return payload
        except (ValueError, KeyError, TypeError) as exc:
            self.connection.acks.remove(
                claimed.owned_path, dead_letter=True,
                reason=f"cannot decode message: {exc!r}; it is kept for inspection")
            self.connection.settled(claimed.owned_path)
            return None

    def _rate_limited(self) -> bool:
        """Whether the process the task starts in may have to hold a rate limit
        (:data:`~celery_zk.features.limit_gate.RATE_LIMITED`). With the limits
        unreadable now (ZooKeeper away) that process looks for itself."""
        try:
            return rate_limited(self.connection.limits())
        except CONNECTION_ERRORS:
            return True

    def withdraw_offers_if_full(self) -> None:
        """A channel that cannot take more must not be handed any (idle workers can)."""
        if self._consuming and not self.qos.can_consume():
            for queue in list(self._consuming):
                self.connection.inbox(queue).full()


    # -- publishing ---------------------------------------------------------------
    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        transport = self.connection
        transport.budget.check(transport.handle.client, queue,
                               transport.queue_limits.of(queue).temporary)   # waits while full
        size = body_size(message)
        transport.queue_limits.before_publish(queue, size)   # reject-publish
        try:
            self._store(queue, message, size)
        except QuotaExceededError as exc:   # the servers enforce the root's quota
            raise budget.refused(transport.layout, exc) from exc
        transport.queue_limits.after_publish(queue, size)   # drop-head

    def _store(self, queue: str, message: dict[str, Any], size: int) -> None:
        affinity = affinity_of(message)   # first: a bad key must fail before any write
        transport = self.connection
        publisher = transport.publisher
        marker = self._once_marker(message)
        task, limit_key = limit_tokens(message, transport.limits(), self._arguments)
        priority = kombu_compat.priority_of(self, message)
        due = delayed.due(message)   # an eta far enough ahead: it waits in delayed/
        new = publisher.new_message(queue, encode_message(message), priority, affinity, size,
                                    task, limit_key, due)   # checks the size
        if marker is not None:   # one multi with its marker, stored now
            if publisher.put_once(new, marker) is None:
                logger.info("celery_zk: not publishing to %r again: %s exists (a chord's "
                            "body, sent by a worker that stopped before it finished the "
                            "chord, or by an attempt of this one whose reply was lost)",
                            queue, marker)
            transport.queues.deferred.flush()
            return
        together = transport.publishing_together()
        if together is not None:   # stored when the group is (see publish_together)
            together.append(new)
            return
        if transport.unconfirmed is not None:
            transport.unconfirmed.put(new)
            return
        # A message with an affinity key waits where the dispatcher chooses a
        # consumer by its key: it is never handed to whichever consumer is idle.
        # Nor is a big one, whose chunks' state its publish multi sets, nor one
        # a limit may hold back (the dispatcher applies limits), nor a delayed one.
        handoff = transport.handoff
        if affinity is not None or due is not None or transport.limited(queue, task):
            publisher.put_new(new)   # the dispatcher orders these itself
        elif new.big or handoff is None or not handoff.give(new):
            name = publisher.put_new(new)
            if handoff is not None:
                handoff.in_line(queue, name)
        transport.queues.deferred.flush()   # the write they waited for has been made

    def _once_marker(self, message: dict[str, Any]) -> str | None:
        """The node a message asks to make with its publish (``ONCE_PROPERTY``),
        taken out of its properties; None unless it is on our ensemble, made
        as the user it was asked for by (its ACL is theirs)."""
        properties = message.get("properties")
        once = properties.pop(ONCE_PROPERTY, None) if isinstance(properties, dict) else None
        if not isinstance(once, dict):
            return None
        settings = self.connection.settings
        if once.get("hosts") != settings.hosts or once.get("username") != settings.username:
            return None
        path = once.get("path")
        return path if isinstance(path, str) and path.startswith("/") else None

    def _arguments(self, message: dict[str, Any]) -> tuple[Any, Any]:
        """A task message's ``(args, kwargs)``, decoded as the worker will (for a
        limit's key: celery_zk.features.limits)."""
        properties = message.get("properties") or {}
        body = self.decode_body(message.get("body"), properties.get("body_encoding"))
        content_type = message.get("content-type")
        decoded = loads(body, content_type, message.get("content-encoding"),
                        accept=[content_type])
        if isinstance(decoded, (list, tuple)) and len(decoded) >= 2:
            return decoded[0] or (), decoded[1] or {}
        return (), {}   # Celery's protocol 1, or not a task

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str,
                    **kwargs: Any) -> None:
        if exchange.endswith(".pidbox"):   # Celery's remote control: keep revokes
            command = control_command(message)
            if command is not None:
                transport = self.connection
                RevokeStore(transport.handle.client, transport.layout).keep(command)
        # Broadcasts are rare and must reach a worker that bound a moment ago.
        queues = {queue for _, queue in self.connection.bindings.table(exchange, fresh=True)}
        for queue in queues:
            self._put(queue, message)

    # -- queues -------------------------------------------------------------------
    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        transport = self.connection
        if queue in transport.declared_queues:
            return
        temporary = bool(kwargs.get("auto_delete") or kwargs.get("exclusive"))
        arguments = dict(kwargs.get("arguments") or {})
        declared = queue_arguments.Limits.of(queue, arguments)   # bad values: before a write
        queue_arguments.warn_unhonoured(queue, arguments)
        meta = queue_arguments.meta(arguments, temporary)
        if temporary:
            transport.auto_delete.declare(queue, meta)  # held while this session lives
        elif transport.queues.declare(queue, meta):
            transport.queue_limits.learn(queue, declared)
        else:   # it existed: its own arguments stay
            transport.queue_limits.declared_again(queue, declared)
        transport.declared_queues.add(queue)

    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> Any:
        # Queue(max_length=...) and the like as RabbitMQ's arguments, which a
        # virtual transport's default drops (see celery_zk.broker.queue_arguments).
        return to_rabbitmq_queue_arguments(arguments, **kwargs)

    def queue_declare(self, queue: str | None = None, passive: bool = False,
                      **kwargs: Any) -> Any:
        """kombu's, with the consumer count filled in for a passive declare
        (generic exporters read it); a plain declare skips that read."""
        ok = super().queue_declare(queue, passive=passive, **kwargs)
        if not passive:
            return ok
        transport = self.connection
        consumers = consumer_count(transport.handle.client, transport.layout, ok.queue)
        return queue_declare_ok_t(ok.queue, ok.message_count, consumers)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.connection.queues.exists(queue)

    def _size(self, queue: str) -> int:
        return self.connection.queues.size(queue)

    def _purge(self, queue: str) -> int:
        return self.connection.queues.purge(queue)

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False,
                     **kwargs: Any) -> None:
        transport = self.connection
        if if_empty and self._size(queue):
            return
        for exchange, routing_key in transport.bindings.bindings_of_queue(queue):
            transport.bindings.unbind(exchange, queue, routing_key)
        self.state.queue_bindings_delete(queue)
        transport.queues.delete(queue)
        transport.declared_queues.discard(queue)
        transport.auto_delete.held.pop(queue, None)
        self._stop_consuming(queue)

    # -- exchanges and bindings ---------------------------------------------------
    def exchange_declare(self, exchange: str | None = None, type: str = "direct",
                         durable: bool = False, auto_delete: bool = False,
                         arguments: Any = None, nowait: bool = False,
                         passive: bool = False) -> None:
        if exchange and passive and exchange not in self.state.exchanges:
            self.typeof(exchange)  # learn it from ZooKeeper if another process declared it
        known = exchange in self.state.exchanges
        super().exchange_declare(exchange, type, durable, auto_delete, arguments,
                                 nowait, passive)
        if exchange and not passive and not known:
            self.connection.bindings.declare_exchange(exchange, type)

    def exchange_delete(self, exchange: str, if_unused: bool = False,
                        nowait: bool = False) -> None:
        super().exchange_delete(exchange, if_unused, nowait)
        self.connection.bindings.delete_exchange(exchange)

    def typeof(self, exchange: str, default: str = "direct") -> Any:
        if exchange and exchange not in self.state.exchanges:
            type_ = self.connection.bindings.exchange_type(exchange)
            if type_:
                self.state.exchanges[exchange] = {
                    "type": type_, "durable": True, "auto_delete": False,
                    "arguments": {}, "table": []}
        return super().typeof(exchange, default)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: Any, queue: str) -> None:
        transport = self.connection
        transport.bindings.bind(exchange, queue, routing_key,
                                ephemeral=queue in transport.auto_delete.held)

    def queue_unbind(self, queue: str, exchange: str | None = None, routing_key: str = "",
                     arguments: Any = None, **kwargs: Any) -> None:
        super().queue_unbind(queue, exchange, routing_key, arguments, **kwargs)
        if exchange:
            self.connection.bindings.unbind(exchange, queue, routing_key)

    def get_table(self, exchange: str) -> list[tuple[str, Any, str]]:
        exchange_type = self.typeof(exchange)
        return [exchange_type.prepare_bind(queue, exchange, routing_key, None)
                for routing_key, queue in self.connection.bindings.table(exchange)]

    def _lookup(self, exchange: str, routing_key: str, default: Any = None) -> list[str]:
        queues = kombu_compat.lookup(self, exchange, routing_key, default)
        fallback = [default if default is not None else self.deadletter_queue]
        if exchange and queues in ([], fallback) and self.typeof(exchange).type == "direct":
            # A direct miss may be a binding made an instant ago elsewhere: re-read once.
            self.connection.bindings.table(exchange, fresh=True)
            queues = kombu_compat.lookup(self, exchange, routing_key, default)
        return queues

    # -- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        if not self.closed:
            for queue in list(self._consuming):
                self._stop_consuming(queue)
        super().close()
