"""Apache ZooKeeper transport for kombu (``zk://``).

Features
========
* Type: Virtual
* Supports Direct: Yes
* Supports Topic: Yes
* Supports Fanout: Yes (bindings are stored in ZooKeeper, shared by all processes)
* Supports Priority: Yes, 0-9, higher first (AMQP semantics); FIFO within a priority
* Supports TTL: No
* Delivery: at-least-once. A claimed message is *owned* by a live ZooKeeper
  session; it goes back to its queue when acked-never and the session ends.
  There is no visibility timeout.
* Waiting: watch-driven; an idle consumer sends ZooKeeper no requests.
* Event loop: yes (``implements.asynchronous``): a Celery worker runs it in its
  event loop, where a busy prefork pool does not block remote control.

Connection String
=================
.. code-block::

    zk://[user:password@]host1[:port][,host2[:port]...][/path][?option=value...]

The path (default ``/celery``) is the root under which every node lives.
kombu's ``;``-separated failover form is accepted and folded into one host
list. Credentials switch on digest authentication and per-node ACLs.

Transport Options
=================
Given as ``broker_transport_options`` or as URL query options (the URL wins):

* ``session_timeout`` (float, 10.0): ZooKeeper session timeout in seconds; a
  dead worker's messages are requeued this long after it dies.
* ``connect_timeout`` (float, 10.0): seconds to wait for the first connection.
  Unless given here, the broker takes kombu's ``Connection(connect_timeout=)``
  (Celery's ``broker_connection_timeout``, 4 s). When nothing listens on any
  host the connection fails at once.
* ``bucket_size`` (int, 4096): waiting messages go in buckets of one priority;
  a publisher starts the next after this many creates (bounds every listing).
* ``claim_batch`` (int, 64): most messages claimed in one transaction (also
  bounded by the consumer's prefetch).
* ``listing_max_age`` (float, 1.0): seconds a consumer may reuse its cached,
  sorted listing of a busy queue before re-reading it.
* ``persistent_watches`` (bool, True): wake an idle consumer with a
  persistent recursive watch that names the new message, so it claims
  without listing the queue (ZooKeeper 3.6+; older servers fall back by
  themselves). False: one-shot child watches only (see
  :mod:`celery_zk.queue_view`).
* ``handoff`` (bool, True): an idle consumer leaves an offer, and a
  publisher that sees it creates the message directly in that consumer's
  name: one durable write per delivery instead of two (see
  :mod:`celery_zk.handoff`). Needs persistent watches.
* ``locality_wait`` (float, 3.0): seconds a consumer leaves a message whose
  affinity key another live worker holds for that worker before taking it
  itself (see :mod:`celery_zk.affinity`). 0: prefer held keys, never wait.
* ``dead_letter_rejected`` (bool, False): keep messages rejected with
  ``requeue=False`` under the queue's ``dead/`` directory.
* ``confirm_publish`` (bool, True): wait for ZooKeeper to store each message
  before a publish returns; False pipelines publishes (see
  :mod:`celery_zk.unconfirmed`: faster, but a killed process loses what was
  still in flight).
* ``batch_groups`` (bool, True): store a group's (or chord header's)
  messages a few hundred per multi when the group is published (see
  :mod:`celery_zk.groups`).
* ``max_message_size`` (int, 1000000): largest encoded message in bytes.
* ``acl`` (str, "auto"): "auto" gives nodes a digest ACL for the URL's user
  (open ACL without credentials); "open" always uses the open ACL.
* ``read_only_users`` (str, ""): comma-separated ``user:password`` pairs that
  get read-only access.
* ``use_ssl`` (bool, False), ``ca``, ``certfile``, ``keyfile``,
  ``keyfile_password`` (str, ""), ``verify_certs`` (bool, True): TLS.
* ``session_name`` (str, ""): connections of a process that agree on hosts,
  credentials, TLS settings, ``session_timeout`` and this name share one
  ZooKeeper session (see :mod:`celery_zk.session`); a name of its own gives a
  connection its own session.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from queue import Empty
from time import monotonic
from typing import Any

import kazoo
from celery.signals import worker_shutting_down
from kazoo.client import KazooState
from kombu.transport import virtual
from kombu.transport.virtual.base import queue_declare_ok_t

from .affinity import Board, affinity_of, board_for
from .autodelete import AutoDeleteQueues
from .bindings import Bindings
from .client import CONNECTION_ERRORS
from .config import (
    DEFAULT_PORT,
    ZKSettings,
    hide_secrets,
    mask_password,
    parse_url,
    reveal_secrets,
)
from .eventloop import Waker
from .groups import install_when_imported
from .handoff import HandOff
from .layout import Layout, parse_message_name
from .liveness import ConsumerSession
from .queue import Claimed, NewMessage, QueueStore
from .queue_view import QueueView
from .revokes import RevokeStore, control_command, load_into_worker
from .session import ClientHandle
from .status import consumer_count
from .unconfirmed import UnconfirmedPublisher
from .watches import TreeWatches

logger = logging.getLogger(__name__)

#: How often a waiting drain_events looks whether a worker shutdown began.
SHUTDOWN_CHECK = 0.25
#: Most messages delivered per wake-up of Celery's event loop before it runs
#: its other work (the pool, timers), and how often it looks unasked (seconds).
EVENT_LOOP_BATCH = 64
EVENT_LOOP_POKE = 1.0

#: Bumped (from a signal handler: a plain int, no lock) when a Celery worker
#: in this process starts a warm or cold shutdown. Transports that existed
#: then stop waiting in drain_events; ones made later are not affected.
_shutdowns = 0

#: The pid that loaded the revokes kept in ZooKeeper (see honour_kept_revokes).
_revokes_loaded_by = 0

#: This thread's open publish_together: the messages it holds, per QueueStore.
_together = threading.local()
install_when_imported()   # a no-op if ``import celery_zk`` already did it


@contextmanager
def publish_together() -> Iterator[None]:
    """Confirmed publishes of this thread to ``zk://`` inside are stored when it
    ends, a few hundred per multi (:meth:`QueueStore.put_batch`), instead of one
    round trip each. Celery's groups and chord headers use it (:mod:`celery_zk.groups`).

    Nested uses join the outermost. Publishes made before an exception are
    stored too, as they would have been one by one. With
    ``confirm_publish=False`` they are stored (and confirmed) the same way:
    fewer requests than pipelined creates, and after those in order.
    """
    if getattr(_together, "held", None) is not None:
        yield
        return
    _together.held = {}
    try:
        yield
    finally:
        held, _together.held = _together.held, None
        failure: BaseException | None = None
        for store, messages in held.items():   # each connection's, in its own order
            try:
                if messages:
                    store.put_batch(messages)
                    store.deferred.flush()   # the write they waited for has been made
            except BaseException as exc:   # the other connections' still go
                failure = failure or exc
        if failure is not None:
            raise failure


@worker_shutting_down.connect(weak=False)
def _on_worker_shutting_down(**_: Any) -> None:
    # Celery runs this inside its SIGTERM/SIGINT handler, which may have
    # interrupted drain_events with a lock held: flag it, take no lock.
    global _shutdowns
    _shutdowns += 1


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


class QoS(virtual.QoS):
    """Acks and rejects are ZooKeeper transactions on the owned node."""

    def __init__(self, channel: Any, prefetch_count: int = 0) -> None:
        super().__init__(channel, prefetch_count)
        # kombu registers an exit hook that holds this QoS, and through it the
        # channel and the transport, until the interpreter exits: a Connection
        # dropped without close() could never be collected. A channel that is
        # closed requeues its unacked messages itself; one that is dropped has
        # them requeued by recovery once its consumer node goes with its lease.
        self._on_collect.cancel()

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
        return len(self._delivered) - len(self._dirty)  # type: ignore[arg-type]

    def ack(self, delivery_tag: str) -> None:
        if self._closed(delivery_tag, "acking"):
            return
        transport = self.channel.connection
        owner = transport.session.node_of(transport.layout.split_owned_path(delivery_tag)[1])
        transport.store.ack_async(delivery_tag, owner)
        super().ack(delivery_tag)
        self.channel.connection.wake()  # a prefetch slot is free

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if self._closed(delivery_tag, "rejecting"):
            return
        message = self._delivered.get(delivery_tag)  # type: ignore[attr-defined]
        if requeue:
            self.channel.requeue_owned(delivery_tag, message)
        else:
            self.channel.connection.store.remove(
                delivery_tag, dead_letter=self.channel.options.dead_letter_rejected,
                reason="rejected with requeue=False")
        self._quick_ack(delivery_tag)
        self.channel.connection.wake()

    def restore_unacked(self) -> list[tuple[BaseException, Any]]:
        """Put every unacked message back (warm shutdown, channel close)."""
        self._flush()
        errors: list[tuple[BaseException, Any]] = []
        delivered = self._delivered
        while delivered:
            tag, message = delivered.popitem()
            try:
                self.channel.requeue_owned(tag, message)
            except BaseException as exc:
                if tag not in self._dirty:
                    errors.append((exc, message))
        return errors


class Channel(virtual.Channel):
    """A kombu channel whose queues live in ZooKeeper."""

    QoS = QoS
    supports_fanout = True
    do_restore = True
    connection: Transport

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self.options = connection.settings.options
        self._views: dict[str, QueueView] = {}
        self._no_ack_queues: set[str] = set()

    # -- consuming ----------------------------------------------------------------
    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        # Register before the first claim: an owned message must always name a session.
        self.connection.session.ensure_registered()
        self.connection.honour_kept_revokes()
        if no_ack:
            self._no_ack_queues.add(queue)
        result = super().basic_consume(queue, no_ack, *args, **kwargs)
        self.connection.consuming_changed()
        self.connection.wake()
        return result

    def basic_qos(self, *args: Any, **kwargs: Any) -> Any:
        result = super().basic_qos(*args, **kwargs)
        self.connection.wake()   # a raised prefetch limit frees slots
        return result

    def _view(self, queue: str) -> QueueView:
        view = self._views.get(queue)
        if view is None:
            view = self._views[queue] = QueueView(self.connection, queue)
        return view

    def reset_watches(self) -> None:
        """After a connection or session change: watches are gone, so look again."""
        for view in list(self._views.values()):
            view.reset()

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:
            self._drop_view(queue)
        if self.connection is not None:   # None once the channel is closed
            self.connection.consuming_changed()
        return result

    def _drop_view(self, queue: str) -> None:
        """Stop watching ``queue`` and give back what was claimed but not delivered."""
        view = self._views.pop(queue, None)
        if view is None:
            return
        view.close()
        store = self.connection.store if self.connection else None
        if store is not None:
            try:
                view.collect(block=True)   # ours now: given back with the buffer
            except CONNECTION_ERRORS:
                pass   # the session's end gives them back
        while view.buffer and store is not None:
            claimed = view.buffer.popleft()
            store.requeue(claimed.owned_path, claimed.data)
        while view.handed and store is not None:   # handed over, not yet delivered
            _, name, _ = view.handed.popleft()
            store.requeue(self.connection.layout.owned_message(queue, name))

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        view = self._view(queue)
        view.consuming = queue in self._active_queues
        while True:
            view.collect()
            if not view.buffer:
                view.fill(self._claim_limit() - view.claiming, self._in_hand())
            if not view.buffer:
                raise Empty()
            claimed = view.buffer.popleft()
            payload = self._decode(claimed)
            if payload is not None:
                if queue in self._no_ack_queues:
                    # No ack will come (event monitors): delivered means done.
                    self.connection.store.discard(claimed.owned_path)
                return payload

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
            self.connection.store.discard(message.delivery_tag)
        return message

    def _decode(self, claimed: Claimed) -> dict[str, Any] | None:
        try:
            payload = json.loads(claimed.data)
            properties = payload["properties"]
            properties["delivery_tag"] = claimed.owned_path
            parsed = parse_message_name(claimed.name)
            if parsed is not None and parsed.requeued:
                # The name says it was requeued (by a reject, a shutdown or a dead owner).
                payload["redelivered"] = True
                properties.setdefault("delivery_info", {})["redelivered"] = True
            return payload
        except (ValueError, KeyError, TypeError) as exc:
            self.connection.store.remove(
                claimed.owned_path, dead_letter=True,
                reason=f"cannot decode message: {exc!r}; it is kept for inspection")
            return None

    def _claim_limit(self) -> int:
        limit = self.options.claim_batch
        estimate = self.qos.can_consume_max_estimate()
        return limit if estimate is None else min(limit, estimate)

    def withdraw_offers_if_full(self) -> None:
        """A channel that cannot take more must not be handed any (idle workers can)."""
        if self._views and not self.qos.can_consume():
            for view in list(self._views.values()):
                view.withdraw()

    def requeue_owned(self, owned_path: str, message: Any = None) -> None:
        # Our cached listing predates the requeued message, which sorts ahead of it.
        queue = self.connection.layout.split_owned_path(owned_path)[0]
        view = self._views.get(queue)
        if view is not None:
            view.invalidate()
        data = json.dumps(message._raw).encode() if message is not None else None
        self.connection.store.requeue(owned_path, data)

    # -- publishing ---------------------------------------------------------------
    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        affinity = affinity_of(message)   # first: a bad key must fail before any write
        data = encode_message(message)
        priority = self._get_message_priority(message)
        transport = self.connection
        store = transport.store
        together = transport.publishing_together()
        if together is not None:   # stored when the group is (see publish_together)
            together.append(store.new_message(queue, data, priority, affinity))
            return
        if transport.unconfirmed is not None:
            transport.unconfirmed.put(queue, data, priority, affinity)
            return
        new = store.new_message(queue, data, priority, affinity)   # checks the size
        # A message with an affinity key waits where every consumer can choose
        # it by its key: it is never handed to whichever consumer is idle.
        if (affinity is not None or transport.handoff is None
                or not transport.handoff.give(queue, data, priority)):
            store.put_new(new)
        transport.store.deferred.flush()   # the write they waited for has been made

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
        if kwargs.get("auto_delete") or kwargs.get("exclusive"):
            transport.auto_delete.declare(queue)  # held while this session lives
        else:
            transport.store.declare(queue, json.dumps({"auto_delete": False}).encode())
        transport.declared_queues.add(queue)

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
        return self.connection.store.exists(queue)

    def _size(self, queue: str) -> int:
        return self.connection.store.size(queue)

    def _purge(self, queue: str) -> int:
        view = self._views.get(queue)
        if view is not None:
            view.invalidate()
        return self.connection.store.purge(queue)

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False,
                     **kwargs: Any) -> None:
        transport = self.connection
        if if_empty and self._size(queue):
            return
        for exchange, routing_key in transport.bindings.bindings_of_queue(queue):
            transport.bindings.unbind(exchange, queue, routing_key)
        self.state.queue_bindings_delete(queue)
        transport.store.delete(queue)
        transport.declared_queues.discard(queue)
        transport.auto_delete.held.discard(queue)
        self._drop_view(queue)

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
        return self._table(exchange, fresh=False)

    def _table(self, exchange: str, fresh: bool) -> list[tuple[str, Any, str]]:
        exchange_type = self.typeof(exchange)
        return [exchange_type.prepare_bind(queue, exchange, routing_key, None)
                for routing_key, queue in self.connection.bindings.table(exchange, fresh)]

    def _lookup(self, exchange: str, routing_key: str, default: Any = None) -> list[str]:
        queues = super()._lookup(exchange, routing_key, default)
        fallback = [default if default is not None else self.deadletter_queue]
        if exchange and queues in ([], fallback) and self.typeof(exchange).type == "direct":
            # A direct miss may be a binding made an instant ago elsewhere: re-read once.
            self.connection.bindings.table(exchange, fresh=True)
            queues = super()._lookup(exchange, routing_key, default)
        return queues

    # -- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        if not self.closed:
            for queue in list(self._views):
                self._drop_view(queue)
        super().close()


class Transport(virtual.Transport):
    """kombu transport storing messages as ZooKeeper sequential nodes."""

    Channel = Channel
    can_parse_url = True
    default_port = DEFAULT_PORT  # type: ignore[assignment]
    driver_type = "zookeeper"
    driver_name = "kazoo"
    polling_interval = None  # type: ignore[assignment]  # never sleeps: waits for watches

    implements = virtual.Transport.implements.extend(
        asynchronous=True,   # register_with_event_loop: see celery_zk.eventloop
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )

    # kombu/celery retry the publish or reconnect on these, not fail the caller.
    connection_errors = virtual.Transport.connection_errors + CONNECTION_ERRORS

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.settings = self._settings(client)
        _hide_secrets(client)
        given = "connect_timeout" in self.settings.given
        self.handle = ClientHandle(
            self.settings, owner=self,
            connect_timeout=None if given or not client.connect_timeout
            else float(client.connect_timeout))
        self.layout = Layout(self.settings.root)
        self.store = QueueStore(self.handle, self.layout, self.settings.options)
        self.bindings = Bindings(self.handle, self.layout)
        self.auto_delete = AutoDeleteQueues(self.handle, self.layout, self.store)
        self.session = ConsumerSession(self.handle, self.layout, self.store)
        self.handoff = (HandOff(self.handle, self.layout, self.store)
                        if self.settings.options.handoff
                        and self.settings.options.persistent_watches else None)
        self._watches: TreeWatches | None = None
        self.declared_queues: set[str] = set()
        self.unconfirmed = (None if self.settings.options.confirm_publish
                            else UnconfirmedPublisher(self.store))
        self._wake = Waker()
        self._loop: Any = None   # the event loop (kombu hub) we are registered with
        self._poke: Any = None
        self._shutdowns_seen = _shutdowns
        self.handle.add_listener(self._on_state)

    @staticmethod
    def _settings(client: Any) -> ZKSettings:
        urls = [reveal_secrets(u, client.password) for u in (client.alt or [client.hostname])
                if u]
        if not urls or "://" not in urls[0]:  # Connection(transport='zk', hostname='h')
            host = client.hostname or "localhost"
            port = client.port or DEFAULT_PORT
            vhost = (client.virtual_host or "").strip("/")
            urls = [f"zk://{host}:{port}/{vhost}"]
        return parse_url(urls, client.transport_options)

    @property
    def watches(self) -> TreeWatches | None:
        """The session's persistent watches (one per session, shared by its connections)."""
        if not self.settings.options.persistent_watches:
            return None
        session = self.handle.session
        watches = self._watches
        if watches is None or watches.handle is not session:
            watches = self._watches = session.singleton(TreeWatches,
                                                        lambda: TreeWatches(session))
        return watches

    @property
    def affinity(self) -> Board:
        """Who holds which affinity key, and what this process holds (celery_zk.affinity)."""
        return board_for(self.handle.session, self.layout, self.watches)

    @property
    def batches_groups(self) -> bool:
        """Whether Celery's groups publish through :func:`publish_together`."""
        return self.settings.options.batch_groups

    def publishing_together(self) -> list[NewMessage] | None:
        """Where this thread's open :func:`publish_together` holds this transport's
        messages; None if there is none (or ``batch_groups`` is off)."""
        held: dict[QueueStore, list[NewMessage]] | None = getattr(_together, "held", None)
        if held is None or not self.settings.options.batch_groups:
            return None
        return held.setdefault(self.store, [])

    def honour_kept_revokes(self) -> None:
        """In a Celery worker, once per process: the revokes kept in ZooKeeper
        join its revoked set before any task is delivered (celery_zk.revokes)."""
        global _revokes_loaded_by
        if _revokes_loaded_by == os.getpid() or "celery.worker.state" not in sys.modules:
            return
        _revokes_loaded_by = os.getpid()
        load_into_worker(self.handle.client, self.layout)

    def consuming_changed(self) -> None:
        """The queues this connection consumes changed: its consumer node says
        which (``celery zk status``, ``queue_declare``'s consumer count)."""
        channels: list[Channel] = list(self.channels or ())
        self.session.set_queues({queue for channel in channels
                                 for queue in channel._active_queues})

    def wake(self) -> None:
        """Something may be deliverable now (new message, free prefetch slot)."""
        self._wake.set()

    def watch_removed(self, queue: str, by: QueueView) -> None:
        """A view removed its watch on ``queue``, taking the session's one-shot
        watches there with it: every other view of the queue on this session (in
        any connection of the process) must look again."""
        for transport in self.handle.peers():
            if not isinstance(transport, Transport) or transport.layout != self.layout:
                continue
            channels: list[Channel] = list(transport.channels or ())
            for channel in channels:
                view = channel._views.get(queue)
                if view is not None and view is not by:
                    view.reset()

    def _on_state(self, state: KazooState) -> None:
        # kazoo's event thread. After a session change the watches are gone.
        channels: list[Channel] = list(self.channels or ())
        for channel in channels:
            channel.reset_watches()
        self._wake.set()

    def establish_connection(self) -> Any:
        self.handle.connect()  # now: a bad URL or dead server fails here, clearly
        return super().establish_connection()

    def close_connection(self, connection: Any) -> None:
        try:
            if self.handle.started:
                self.store.deferred.flush()   # acks held back must land before we go
            if self.unconfirmed is not None and not self.unconfirmed.flush(
                    timeout=2 * self.settings.options.session_timeout):
                logger.error("celery_zk: closing with %d unconfirmed publish(es) in flight",
                             self.unconfirmed.in_flight)
            super().close_connection(connection)
            if self.handle.started:
                self.auto_delete.release_all()
        finally:
            self.unregister_from_event_loop(connection, self._loop)
            self.session.close()
            self.handle.close()

    def drain_events(self, connection: Any, timeout: float | None = None,
                     **kwargs: Any) -> None:
        deadline = None if timeout is None else monotonic() + timeout
        while True:
            if self._shutdowns_seen != _shutdowns:
                # A worker shutdown began. Celery's synchronous loop notices it
                # only when this returns (and then calls it once more): return
                # at once, and deliver nothing new, from now on.
                raise socket.timeout()
            if self._deliver_one():
                return
            if deadline is not None and deadline <= monotonic():
                raise socket.timeout()
            self._wait(deadline)

    def _deliver_one(self) -> bool:
        """Deliver one message if one can be delivered now; True if it was."""
        self._wake.clear()
        # After a session expiry (else no-ops): queues first, then what routes to them.
        self.auto_delete.restore()
        self.bindings.restore_ephemeral()
        try:
            assert self.cycle is not None
            self.cycle.get(self._deliver)
            return True
        except Empty:
            pass
        channels: list[Channel] = list(self.channels or ())
        for channel in channels:
            channel.withdraw_offers_if_full()
        return False

    # -- Celery's event loop ------------------------------------------------------
    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """Deliver from the worker's event loop, woken through :class:`Waker`'s pipe."""
        self.unregister_from_event_loop(connection, self._loop)
        self._loop = loop
        loop.add_reader(self._wake.fileno(), self._on_readable)
        # A safety net for a wake-up nothing sends (a prefetch limit raised by
        # Celery's QoS): an idle look costs no request.
        self._poke = loop.call_repeatedly(EVENT_LOOP_POKE, self.wake)
        self.wake()   # what is waiting already

    def unregister_from_event_loop(self, connection: Any, loop: Any) -> None:
        if self._loop is not None:
            try:
                self._loop.remove_reader(self._wake.fileno())
            except Exception:   # the hub was reset (a connection error): nothing to remove
                pass
        if self._poke is not None:
            self._poke.cancel()
        self._loop = self._poke = None

    def _on_readable(self) -> None:
        # Bounded, so the loop also runs the pool and timers; the rest next turn.
        for _ in range(EVENT_LOOP_BATCH):
            if not self._deliver_one():
                return
        self.wake()

    def _wait(self, deadline: float | None) -> None:
        """Until woken, the deadline or a worker shutdown, whichever comes first."""
        while self._shutdowns_seen == _shutdowns:
            remaining = None if deadline is None else deadline - monotonic()
            if remaining is not None and remaining <= 0:
                return
            # Short waits: the shutdown signal may land on another thread and
            # not interrupt this one.
            if self._wake.wait(SHUTDOWN_CHECK if remaining is None
                               else min(remaining, SHUTDOWN_CHECK)):
                return

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        # kombu passes the Connection's hostname, which _hide_secrets masked.
        if include_password:
            return reveal_secrets(uri, self.client.password if self.client else None)
        return mask_password(uri)

    def driver_version(self) -> str:
        return getattr(kazoo, "__version__", "unknown")


def _hide_secrets(client: Any) -> None:
    """Keep passwords out of ``Connection.info()`` (``celery inspect stats``, Flower).

    kombu shows ``hostname`` and ``alternates`` there, and for a transport that
    parses its own URL those are whole URLs. They are replaced by masked ones;
    :func:`~celery_zk.config.reveal_secrets` gives the real URL back to this
    process (``Connection.clone()``, reconnects). The password itself moves to
    the Connection's ``password`` field, which Celery leaves out of the stats
    and kombu's pools use to tell connections apart.
    """
    urls = [client.hostname, *(client.alt or [])]
    if not any(isinstance(u, str) and "://" in u for u in urls):
        return
    settings = parse_url([u for u in urls if isinstance(u, str)])
    if settings.password is not None and client.password is None:
        client.userid, client.password = settings.username, settings.password
    if isinstance(client.hostname, str):
        client.hostname = hide_secrets(client.hostname, client.password)
    if client.alt:
        client.alt = [hide_secrets(u, client.password) if isinstance(u, str) else u
                      for u in client.alt]
