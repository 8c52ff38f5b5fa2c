"""Apache ZooKeeper transport for kombu (``zk://``).

Features
========
* Type: Virtual
* Supports Direct: Yes
* Supports Topic: Yes
* Supports Fanout: Yes (bindings are stored in ZooKeeper, shared by all processes)
* Supports Priority: Yes, 0-9, higher first (AMQP semantics); FIFO within a priority
* Supports TTL: No
* Delivery: at-least-once. One dispatcher per queue, elected among its
  consumers, moves waiting messages' names into consumers' inboxes; a
  message in an inbox is *owned* by a live ZooKeeper session and goes back to
  its queue when never acked and the session ends. There is no visibility
  timeout.
* Waiting: watch-driven; an idle consumer sends ZooKeeper no requests, and
  watches only its own inbox.
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
* ``claim_batch`` (int, 64): most messages a consumer takes out of its inbox
  at a time, and its inbox's credit when its prefetch is unlimited.
* ``lookahead`` (int, 16): a consumer that runs dry while delivering fast may
  hold this many times its prefetch in its inbox (1: never more than the
  prefetch); what waits there while its prefetch is full for 1 s goes back.
* ``handoff`` (bool, True): a consumer with a free pool slot leaves an
  offer, and a publisher that sees it puts the message straight into that
  consumer's inbox (see :mod:`celery_zk.broker.handoff`): one synced write
  on the path instead of two, and the offer stands for the next message.
  Needs persistent watches.
* ``locality_wait`` (float, 3.0): seconds the dispatcher keeps a message whose
  affinity key a live worker holds for that worker before giving it to
  another (see :mod:`celery_zk.features.affinity`); the oldest waiting message
  is given first once it has been the oldest this long. 0: never wait.
* ``dead_letter_rejected`` (bool, False): keep messages rejected with
  ``requeue=False``, expired ones and those a queue's length drops under the
  queue's ``dead/`` directory.
* ``confirm_publish`` (bool, True): wait for ZooKeeper to store each message
  before a publish returns; False pipelines publishes (see
  :mod:`celery_zk.broker.unconfirmed`: faster, but a killed process loses what was
  still in flight).
* ``batch_groups`` (bool, True): store a group's (or chord header's)
  messages a few hundred per multi when the group is published (see
  :mod:`celery_zk.broker.groups`).
* ``max_message_size`` (int, 16777216): largest message body in bytes; a
  bigger one fails its publish with MessageTooLarge, before anything is
  written.
* ``chunk_size`` (int, 131072): a message stored bigger than this is written
  as chunks before it is visible (see :mod:`celery_zk.broker.big`).
* ``acl`` (str, "auto"): "auto" gives nodes a digest ACL for the URL's user
  (open ACL without credentials); "open" always uses the open ACL.
* ``read_only_users`` (str, ""): comma-separated ``user:password`` pairs that
  get read-only access.
* ``use_ssl`` (bool, False), ``ca``, ``certfile``, ``keyfile``,
  ``keyfile_password`` (str, ""), ``verify_certs`` (bool, True): TLS.
* ``session_name`` (str, ""): connections of a process that agree on hosts,
  credentials, TLS settings, ``session_timeout`` and this name share one
  ZooKeeper session (see :mod:`celery_zk.zk.session`); a name of its own gives a
  connection its own session.
* ``max_result_size`` (int, 16777216): the result backend's (see
  :mod:`celery_zk.backend.payloads`).
* ``expire_every`` (float, 600.0): how often, in seconds, a worker looks
  whether its root is due for a round of deleting queues unused for their
  ``x-expires`` (0: none; :mod:`celery_zk.broker.queue_expiry`); the result
  backend's deletes expired results so (:mod:`celery_zk.backend.autoexpire`).
* ``budget_nodes`` (int, 400000), ``budget_bytes`` (int, 134217728),
  ``budget_wait`` (float, 60.0): the storage budget of the root, counted by
  the servers' quota; over it a publish waits, then fails with
  ``StorageFull`` (see :mod:`celery_zk.broker.budget`).
"""
from __future__ import annotations

import logging
import socket
from queue import Empty
from time import monotonic
from typing import Any

import kazoo
from kazoo.client import KazooState
from kazoo.exceptions import SessionExpiredError
from kombu.transport import virtual

from ..compat import celery_pool
from ..compat import kazoo as kazoo_compat
from ..compat import kombu as kombu_compat
from ..features.affinity import Board, board_for
from ..features.limits import book_for
from ..zk.client import CONNECTION_ERRORS
from ..zk.config import (
    DEFAULT_PORT,
    MASK,
    ZKSettings,
    hide_secrets,
    mask_password,
    parse_url,
    reveal_secrets,
)
from ..zk.layout import Layout
from ..zk.session import ClientHandle
from ..zk.watches import TreeWatches, watches_of
from .acks import Acks
from .autodelete import AutoDeleteQueues
from .bindings import Bindings
from .budget import budget_for
from .channel import Channel
from .eventloop import Waker
from .groups import held_by_this_thread
from .handoff import HandOff
from .inbox import Inbox
from .liveness import ConsumerSession
from .publish import NewMessage, Publisher
from .queue_limits import QueueLimits
from .queues import Queues
from .unconfirmed import UnconfirmedPublisher

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

#: What a Celery worker of this process adds (``celery_zk.worker.hooks``; set
#: at ``worker_init``): None in every other process.
worker: Any = None


def shutdown_started() -> None:
    """A Celery worker of this process begins its shutdown (a signal handler)."""
    global _shutdowns
    _shutdowns += 1


class Transport(virtual.Transport):
    """kombu transport storing messages as ZooKeeper sequential nodes."""

    Channel = Channel
    can_parse_url = True
    default_port = DEFAULT_PORT  # type: ignore[assignment]
    driver_type = "zookeeper"
    driver_name = "kazoo"
    polling_interval = None  # type: ignore[assignment]  # never sleeps: waits for watches

    implements = virtual.Transport.implements.extend(
        asynchronous=True,   # register_with_event_loop: see celery_zk.broker.eventloop
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )

    # kombu/celery retry the publish or reconnect on these, not fail the caller.
    connection_errors = virtual.Transport.connection_errors + CONNECTION_ERRORS

    def __init__(self, client: Any, **kwargs: Any) -> None:
        kombu_compat.require()   # this kombu has what the transport reads, or a clear error
        kazoo_compat.require()   # and this kazoo what it needs to send addWatch
        super().__init__(client, **kwargs)
        self.settings = self._settings(client)
        _hide_secrets(client)
        given = "connect_timeout" in self.settings.given
        self.handle = ClientHandle(
            self.settings,
            connect_timeout=None if given or not client.connect_timeout
            else float(client.connect_timeout))
        self.layout = Layout(self.settings.root)
        self.queues = Queues(self.handle, self.layout, self.settings.options)
        self.budget = budget_for(self.settings.hosts, self.layout, self.settings.options)
        self.acks = Acks(self.queues)
        self.queue_limits = QueueLimits(self.queues, self.acks)
        self.publisher = Publisher(self.queues, names_size=self.queue_limits.counts_bytes)
        self.bindings = Bindings(self.handle, self.layout, self.wake)
        self.auto_delete = AutoDeleteQueues(self.handle, self.layout, self.queues)
        self.session = ConsumerSession(self.handle, self.layout)
        self.handoff = (HandOff(self.handle, self.layout, self.queues)
                        if self.settings.options.handoff else None)
        self.declared_queues: set[str] = set()
        self.inboxes: dict[str, Inbox] = {}
        self.unconfirmed = (None if self.settings.options.confirm_publish
                            else UnconfirmedPublisher(self.publisher))
        self._wake = Waker()
        self._loop: Any = None   # the event loop (kombu hub) we are registered with
        self._poke: Any = None
        self._shutdowns_seen = _shutdowns
        self._session_lost = False
        self.handle.add_listener(self._on_state)
        self._stamps = False   # this connection stamps prefork hand-overs (it consumes)
        if worker is not None:
            worker.connection_made(self)

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
    def watches(self) -> TreeWatches:
        """The session's persistent watches (one per session, shared by its connections)."""
        return watches_of(self.handle.session)

    @property
    def affinity(self) -> Board:
        """Who holds which affinity key, and what this process holds
        (:mod:`celery_zk.features.affinity`)."""
        return board_for(self.handle.session, self.layout)

    @property
    def batches_groups(self) -> bool:
        """Whether Celery's groups publish through :func:`publish_together`."""
        return self.settings.options.batch_groups

    def publishing_together(self) -> list[NewMessage] | None:
        """Where this thread's open :func:`publish_together` holds this transport's
        messages; None if there is none (or ``batch_groups`` is off)."""
        held: dict[Publisher, list[NewMessage]] | None = held_by_this_thread()
        if held is None or not self.settings.options.batch_groups:
            return None
        return held.setdefault(self.publisher, [])

    def limits(self) -> list[Any]:
        """The limits under our root (:mod:`celery_zk.features.limits`)."""
        return book_for(self.handle.session, self.layout).current()

    def limited(self, queue: str, task: str | None) -> bool:
        """Whether a limit may hold back a message of ``task`` (its token) on
        ``queue`` (then only the dispatcher may give it: no hand-off)."""
        return book_for(self.handle.session, self.layout).holds(queue, task)

    def prepare_worker(self) -> None:
        """Before any task is delivered, in a Celery worker (``celery_zk.worker``)."""
        if worker is not None:
            worker.consuming(self)

    def consuming_changed(self) -> None:
        """The queues this connection consumes changed: its consumer node says
        which (``celery zk status``, ``queue_declare``'s consumer count)."""
        channels: list[Channel] = list(self.channels or ())
        self.session.set_queues({queue for channel in channels
                                 for queue in kombu_compat.consumed_queues(channel)})

    def wake(self) -> None:
        """Something may be deliverable now (new message, free prefetch slot)."""
        self._wake.set()

    @property
    def in_event_loop(self) -> bool:
        """Whether Celery's event loop drives this connection (else a blocking
        ``drain_events`` does, only while its caller waits)."""
        return self._loop is not None

    def look_again(self, delay: float) -> Any:
        """Wake in ``delay`` s: the event loop's timer (``cancel()`` stops it), or
        None when no event loop can (a blocking consumer, whose process runs no
        Celery worker, never needs it: see Inbox.fill)."""
        loop = self._loop
        if loop is None:
            return None
        return loop.call_later(delay, self.wake)

    def inbox(self, queue: str) -> Inbox:
        """This connection's inbox on ``queue`` (its channels share it)."""
        inbox = self.inboxes.get(queue)
        if inbox is None:
            inbox = self.inboxes[queue] = Inbox(self, queue)
        return inbox

    def settled(self, delivery_tag: str) -> None:
        """A delivered message was acked, rejected or requeued."""
        try:
            queue, _, name = self.layout.split_owned_path(delivery_tag)
        except ValueError:
            return
        inbox = self.inboxes.get(queue)
        if inbox is not None:
            inbox.settled(name)

    def _on_state(self, state: KazooState) -> None:
        # kazoo's event thread. After a session change the watches are gone.
        if state == KazooState.LOST and self.inboxes:
            self._session_lost = True   # drain_events raises it (see _deliver_one)
            # What was delivered under the lost session goes to others: a thread
            # pool must not start it, not even in the instant before Celery's
            # consumer hears of it (it flushes the pool then too).
            celery_pool.drop_unstarted_thread_tasks()
        for inbox in list(self.inboxes.values()):
            inbox.reset()
        self._wake.set()

    def establish_connection(self) -> Any:
        self.handle.connect()  # now: a bad URL or dead server fails here, clearly
        return super().establish_connection()

    def close_connection(self, connection: Any) -> None:
        try:
            if self.handle.started:
                self.queues.deferred.flush()   # acks held back must land before we go
                self.acks.send_held_acks()   # ours, even if another thread's flush took them
                if not self.acks.acks_landed(timeout=self.settings.options.session_timeout):
                    logger.warning("celery_zk: closing before every ack landed; the "
                                   "messages not acked will run again (at-least-once)")
            if self.unconfirmed is not None and not self.unconfirmed.flush(
                    timeout=2 * self.settings.options.session_timeout):
                logger.error("celery_zk: closing with %d unconfirmed publish(es) in flight",
                             self.unconfirmed.in_flight)
            super().close_connection(connection)
            for inbox in list(self.inboxes.values()):   # channels closed: their inboxes too
                if inbox.consuming:
                    inbox.close()
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

    def _deliver_one(self, clear: bool = True) -> bool:
        """Deliver one message if one can be delivered now; True if it was.

        ``clear``: reset the wake-up first (a batch of deliveries does it once).
        """
        if self._session_lost:
            # What this connection was given under the ended session is being
            # given to others (recovery). Like a lost AMQP connection, say so:
            # Celery then drops the messages it holds and has not started
            # (prefetched, waiting on a countdown) and reconnects; without it
            # a worker ran them after others had (the nemesis found it).
            self._session_lost = False
            raise SessionExpiredError(
                "celery_zk: this connection's ZooKeeper session expired; the messages "
                "given to it go to other consumers. Reconnect.")
        if clear:
            self._wake.clear()
        # After a session expiry (else no-ops): queues first, then what routes to them
        # (and bindings another session had made, gone with it).
        self.auto_delete.restore()
        if self.bindings.reclaim() and worker is not None:
            worker.bindings_restored(self)
        deliver = kombu_compat.deliver_callback(self)
        channels: list[Channel] = list(self.channels or ())
        if any(channel.deliver_no_ack_first(deliver) for channel in channels):
            return True
        try:
            assert self.cycle is not None
            self.cycle.get(deliver)
            return True
        except Empty:
            pass
        for channel in channels:
            channel.withdraw_offers_if_full()
        return False

    # -- Celery's event loop ------------------------------------------------------
    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """Deliver from the worker's event loop, woken through :class:`Waker`'s pipe."""
        self.unregister_from_event_loop(connection, self._loop)
        self._loop = loop
        loop.add_reader(self._wake.fileno(), self._on_readable)
        # A wake-up nothing else sends: a busy worker still looks whether what
        # its full prefetch holds back should go back (HOLD, broker.credit).
        # With the hand-off on, its offer's look-again does it too; with it off
        # only this does. An idle look costs no request.
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
        # The wake-up is reset once: set again meanwhile, it brings the loop back.
        for turn in range(EVENT_LOOP_BATCH):
            if not self._deliver_one(clear=turn == 0):
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
    :func:`~celery_zk.zk.config.reveal_secrets` gives the real URL back to this
    process (``Connection.clone()``, reconnects). The password itself moves to
    the Connection's ``password`` field, which Celery leaves out of the stats
    and kombu's pools use to tell connections apart.
    """
    # After kombu's failover switch (Connection.switch) the hostname is a bare
    # host parsed out of one URL; the URLs are still in ``alt``.
    urls = [reveal_secrets(u, client.password) for u in (client.hostname, *(client.alt or []))
            if isinstance(u, str) and "://" in u]
    if not urls:
        return
    settings = parse_url(urls)
    if settings.password is not None and client.password in (None, MASK):
        client.userid, client.password = settings.username, settings.password
    if isinstance(client.hostname, str):
        client.hostname = hide_secrets(client.hostname, client.password)
    if client.alt:
        client.alt = [hide_secrets(u, client.password) if isinstance(u, str) else u
                      for u in client.alt]
