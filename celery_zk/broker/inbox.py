"""One connection's consumption of one queue: its inbox.

A consumer never lists its queue. It registers a node under the queue's
``consumers/`` (ephemeral; its data says the consumer's *credit*, how many
messages its inbox may hold, which is the channel's prefetch) and the queue's
dispatcher (:mod:`celery_zk.broker.dispatcher`) moves waiting names into its
inbox, ``owned/{consumer}/``, as its credit allows; a consumer with nothing
waiting in its inbox and a free slot in its worker's pool also leaves an
offer, and a publisher may hand a message straight into the inbox
(:mod:`celery_zk.broker.handoff`). The consumer watches only its inbox: a
persistent watch that names each new entry.

For each new entry it reads the body from ``bodies/``, many in one
``multiRead`` (:mod:`celery_zk.zk.reads`), and delivers in the queue's
order. Only it deletes from its inbox (acks, in :mod:`celery_zk.broker.acks`),
so nothing it does can conflict.

**Lookahead.** A refill follows an ack by two synced writes (the ack's
multi, then the dispatcher's), so a consumer whose tasks take less than that
empties its inbox and waits. A consumer that delivered its whole prefetch
within :data:`FAST` s and then found its inbox empty publishes the
``lookahead`` option (16) times its prefetch as its credit; one idle for
:data:`IDLE` s publishes its prefetch again. Messages beyond what the
channel may take wait in the inbox; held there :data:`HOLD` s while the
channel takes none (a long task), they go back to the queue in their places.

Watch callbacks only record what happened and wake the transport; every
request is made from the consuming thread (see ``docs/design.md``: a request
made on kazoo's connection thread can block it for good).
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kazoo.exceptions import NodeExistsError, NoNodeError, NotEmptyError

from ..exceptions import ChunkMissing
from ..features import affinity
from ..zk.client import CONNECTION_ERRORS, RedoThread, create_once, log_failure, reply_or_retry
from ..zk.names import parse_message_name, sort_messages
from ..zk.reads import read_many
from ..zk.session import weak_callback
from ..zk.watches import NODE_CREATED, NODE_DELETED
from . import big
from .claims import Claimed
from .dispatcher import Dispatcher
from .handoff import Offer
from .ready import DeliveryOrder, Key, Ready

if TYPE_CHECKING:   # the protocol's module imports nothing of ours that imports this one
    from .connection import ZKConnection

__all__ = ["Inbox"]

logger = logging.getLogger(__name__)

#: A consumer that delivered its prefetch's worth within this many seconds and
#: then ran dry waits for refills: its inbox may hold the ``lookahead`` option
#: times its prefetch.
FAST = 0.1
#: Seconds without a delivery after which the lookahead ends.
IDLE = 1.0
#: Seconds undelivered messages may wait in the inbox while the channel takes
#: none (its prefetch is full: a long task) before they go back to the queue.
HOLD = 1.0
#: Seconds between two looks of a full channel at what waits in its inbox.
HOLD_LOOK = 0.01
#: Seconds after which an idle consumer whose worker still runs tasks looks
#: again whether it may make an offer (nothing wakes it when a task ends: Celery
#: acked it as it started), doubled while they run, up to the second.
LOOK_AGAIN = (0.005, 1.0)
#: Seconds a consumer keeps its offer while every pool slot is taken by what
#: publishers handed over (a burst of a trickle, not a backlog): short tasks
#: free a slot within that, and withdrawing (a synced delete, then a new
#: offer: a create) put every message published meanwhile in line, through
#: the dispatcher. Slots taken longer (long tasks) withdraw it: a message
#: handed over meanwhile waits for a slot, as a message prefetched by a
#: busy worker does on any broker. Work from the dispatcher that takes
#: every slot (a backlog) withdraws it at once.
BUSY_GRACE = 0.02
#: Seconds a consumer in an event loop waits, dry and with a free pool slot,
#: before its next offer once an offer was withdrawn because the dispatcher's
#: work filled its slots (the queue has a backlog, as in a drain: an offer
#: would be withdrawn again within moments, two synced writes for nothing).
#: The first such withdrawal waits the first, each next one twice as long, up
#: to the second; none once a publisher hands a message over or the
#: dispatcher's work leaves a slot free (a burst in a steady trickle).
OFFER_AFTER = (0.01, 1.0)
def held_back(waiting: int, took: Sequence[float], now: float) -> int:
    """How many of ``waiting`` messages the pace of the deliveries made at
    ``took`` (the last prefetch's worth) would not deliver within HOLD s."""
    if not waiting:
        return 0
    if not took:
        return waiting
    return max(0, waiting - int(len(took) * HOLD / max(now - took[0], 1e-6)))


class Inbox:
    """One connection's inbox on one queue, shared by its channels."""

    def __init__(self, transport: ZKConnection, queue: str) -> None:
        self.transport = transport
        self.queue = queue
        self.options = transport.settings.options
        self.consumer_id: str | None = None   # the registration the inbox belongs to
        self.node: str | None = None          # our node under the queue's consumers/
        self.credit = 0                       # what the node says
        self.prefetch = 0                     # the channels' prefetch (0: unlimited)
        self.deep = False                     # lookahead on: credit lookahead x prefetch
        self.took: deque[float] = deque()     # when the last `prefetch` deliveries were
        self.held_since: float | None = None  # the inbox fell behind its pace (_hold)
        self._hold_look_at = 0.0              # when _hold looks again
        self.consuming = 0                    # channels consuming it
        self.taken: set[str] = set()          # entries read or being read (not to take twice)
        self.delivered: set[str] = set()      # entries handed to kombu, not yet settled
        # (name, read, when the read was sent, its key) in delivery order
        self.pending: deque[tuple[str, Any, float, Key]] = deque()
        self.pending_first: Key | None = None   # the first of them in delivery order
        self.buffer = Ready()                 # read, not delivered yet
        self.order = DeliveryOrder()          # where what arrives goes (see broker.ready)
        self.arrivals: deque[str] = deque()   # names the tree watch reported
        self.departures: deque[str] = deque()   # and those it saw go
        self.stale = True   # list the inbox before trusting the watch
        self._watching = False   # our watch on the inbox was added
        self._waiting_credit = False
        self.offer = Offer(transport.handoff, queue) if transport.handoff is not None else None
        self._look_in = LOOK_AGAIN[0]   # the next look-again's delay
        self._look_at = 0.0             # when the one asked for is due
        self._look_timer: Any = None    # and its timer, cancelled by a delivery
        self._idle_since: float | None = None   # dry (nothing to deliver) since
        self._busy_since: float | None = None   # every pool slot taken since
        self._offer_after = 0.0
        # What the last fill was told: tasks in hand, and how many run at once.
        self._in_hand, self._slots = 0, 1
        # Looked up on every turn of the consuming loop, so kept: our inbox's path
        # (for consumer_id) and the queue's dispatcher (for a session).
        self._path: tuple[str | None, str] = (None, "")
        self._duty: tuple[Any, Dispatcher | None] = (None, None)
        self._lock = threading.Lock()
        self._tree_cb = weak_callback(self._on_tree)

    # -- kazoo's threads: record and wake -------------------------------------
    def _on_tree(self, event_type: int, name: str) -> None:
        if not name or "/" in name:
            return
        if event_type == NODE_CREATED:
            self.arrivals.append(name)
            self.transport.wake()
        elif event_type == NODE_DELETED:
            self.departures.append(name)   # acked or given back: forget it

    def reset(self) -> None:
        """After a connection or session change: the watch may be gone; list again."""
        self.stale = True
        self.transport.wake()

    # -- registration -----------------------------------------------------------
    def _registered(self) -> str | None:
        """Our consumer id, registered on the queue (again after a session expiry);
        None while the queue does not exist (an auto-delete queue swept while we
        were away, until the transport declares it again)."""
        transport = self.transport
        consumer_id, _ = transport.session.ensure_registered()
        if consumer_id != self.consumer_id and not self._new_identity(consumer_id):
            return None
        if self.consuming:
            if self.node is None:
                self._join()
            self._dispatcher().watch()   # a flag check, unless the election needs a look
        return consumer_id

    def _new_identity(self, consumer_id: str) -> bool:
        """A new registration (first use, or after the session expired): what the
        old inbox held is the recovery leader's now. False when there is no
        queue to make our inbox in (yet)."""
        if not self._make_inbox(consumer_id):
            return False
        old = self.consumer_id
        self.consumer_id = consumer_id
        self.node = None
        self.taken.clear()
        self.delivered.clear()
        self.pending.clear()
        self.pending_first = None
        self.buffer.clear()
        self.arrivals.clear()
        self.stale = True
        self._stop_watch()
        if old is not None:
            self._dispatcher().leave(old)
        return True

    def _make_inbox(self, consumer_id: str) -> bool:
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

    def _dispatcher(self) -> Dispatcher:
        transport = self.transport
        session = transport.handle.session
        cached_for, dispatcher = self._duty
        if cached_for is not session or dispatcher is None:
            dispatcher = Dispatcher.of(session, transport.layout, self.options, self.queue)
            self._duty = (session, dispatcher)
        return dispatcher

    def _join(self) -> None:
        """Register under the queue's consumers/ with our credit; the dispatcher
        gives us work from then on."""
        transport, consumer_id = self.transport, self.consumer_id
        assert consumer_id is not None
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
        self._dispatcher().join(consumer_id, transport.wake)

    def _data(self) -> bytes:
        return json.dumps({"credit": self.credit, "worker": affinity.WORKER,
                           "host": socket.gethostname(), "pid": os.getpid()}).encode()

    def set_credit(self, prefetch: int) -> None:
        """The consuming channels' prefetch, which sets what the dispatcher may put
        in our inbox (more with the lookahead)."""
        if prefetch != self.prefetch:
            self.prefetch = prefetch
            self.took = deque(self.took, maxlen=prefetch or 1)
            self._publish_credit()

    def _publish_credit(self) -> None:
        """Written without waiting: it changes rarely (Celery raises the prefetch
        for ETA tasks, autoscaling changes it, the lookahead starts or ends)."""
        credit = self.prefetch * (self.options.lookahead if self.deep else 1)
        if credit == self.credit:
            return
        self.credit = credit
        if self.node is None or not self.transport.handle.started:
            return
        path = self.node

        def done(result: Any) -> None:   # kazoo's thread: never block
            try:
                result.get()
            except NoNodeError:
                pass   # gone with the session: registering again writes it
            except Exception as exc:
                log_failure(logger, exc, "celery_zk: could not update %s", path)
        self.transport.handle.client.set_async(path, self._data()).rawlink(done)

    def start(self) -> None:
        """A channel starts consuming the queue."""
        self.consuming += 1
        if self.consuming == 1:
            # Joined now, not on the first look: the dispatcher fills the inbox
            # while the worker finishes starting (its basic_consume comes right
            # before worker_ready), as a RabbitMQ consumer is sent its prefetch.
            try:
                self._registered()
            except CONNECTION_ERRORS:
                pass   # the first look joins, once connected again

    def stop(self, channel_closing: bool = False) -> None:
        """A channel stops consuming the queue; the last one out leaves the
        queue's consumers/ and gives back what it was given and did not deliver."""
        self.consuming = max(0, self.consuming - 1)
        if self.consuming:
            return
        self.close()

    # -- the consuming thread -------------------------------------------------------
    def fill(self, limit: int, in_hand: int, slots: int = 1) -> None:
        """Make up to ``limit`` messages ready in :attr:`buffer` (``in_hand``:
        delivered and not done with; ``slots``: how many the worker runs at once)."""
        consumer_id = self._registered()
        if consumer_id is None:
            return
        if limit <= 0:
            self._withdraw()
            self._hold(consumer_id)
            return
        self.held_since = None
        self._in_hand, self._slots = in_hand, max(1, slots)
        self._learn(consumer_id)
        self._read_bodies(limit)
        store = self.transport.store
        waiting, half = len(self.buffer) + len(self.pending), (
            self.credit or self.options.claim_batch) // 2
        if waiting <= half and waiting + store.holds_acks(self._inbox_path()) > half:
            # Running low, and what the dispatcher counts in our inbox is above
            # half our credit only because of acks held back: it refills the
            # inbox only once it sees them, so they go now, not in ACK_HOLD,
            # and the refill overlaps what is left instead of following it.
            # Only then: an inbox that never fills (a worker's remote-control
            # queue, looked at on every turn of its event loop; a trickle
            # handed over one message at a time) sent every ack alone.
            store.deferred.flush()
        if self.buffer:
            return
        if self.pending:
            # The first read has not landed: wait for it (the others were sent with it).
            self._read_bodies(limit, block=True)
            return
        self._dry()
        slots = self._slots
        if in_hand < slots:
            self._busy_since = None
        elif self.offer is not None and self.offer.outstanding:
            self._withdraw_when_busy()   # every slot taken: a handed message would wait
        offer = self._offer_to_make()
        if offer is not None:
            # Dry since: after a backlog (see OFFER_AFTER) a consumer refilled
            # within moments makes no offer it would withdraw; one that stayed
            # dry while its tasks ran has no backlog behind it.
            now = time.monotonic()
            if self._idle_since is None:
                self._idle_since = now
            wait = self._idle_since + self._offer_after - now
            if in_hand >= slots:
                self._look_again(wait)
                return
            if wait > 0 and self._look_again(wait):
                return
            self._look_in = LOOK_AGAIN[0]
            # A free slot: let a publisher hand us the next one.
            offer.make(consumer_id)

    def _offer_to_make(self) -> Offer | None:
        """Our offer, when we may make it: consuming, fewer delivered and not
        settled than the worker's slots, none out already, and the inbox's
        watch held (what is handed over is heard of)."""
        offer = self.offer
        if (self.consuming and len(self.delivered) < self._slots and offer is not None
                and not offer.outstanding and self._watching):
            return offer
        return None

    def _look_again(self, wait: float) -> bool:
        """Come back when the offer's ``wait`` is over and, while our worker still
        runs tasks we delivered (acked as they started), after a delay doubled
        each time: nothing else tells us when they are done. A delivery
        meanwhile cancels it: a consumer in a drain is not woken for it. False
        without an event loop."""
        now = time.monotonic()
        if now < self._look_at:
            return True   # asked for already
        delay = max(self._look_in, wait)
        self._look_in = min(self._look_in * 2, LOOK_AGAIN[1])
        timer = self.transport.look_again(delay)
        if timer is None:
            return False
        self._look_timer, self._look_at = timer, now + delay
        return True

    def _dry(self) -> None:
        """Nothing to deliver while the channel could take more: a consumer that
        delivered its prefetch within FAST s waits for refills (lookahead on);
        one idle for IDLE s needs no lookahead."""
        now = time.monotonic()
        took = self.took
        if not self.deep:
            if (self.prefetch and self.options.lookahead > 1 and len(took) == self.prefetch
                    and now - took[0] <= FAST):
                self.deep = True
                self._publish_credit()
        elif not took or now - took[-1] > IDLE:
            self.deep = False
            self._publish_credit()

    def _hold(self, consumer_id: str) -> None:
        """The channel takes nothing now (its prefetch is full): when what waits
        in the inbox would take more than HOLD s to deliver at the pace of the
        last deliveries, and has for HOLD s, it goes back to the queue, for
        other consumers, and the lookahead ends."""
        now = time.monotonic()
        # Asked after every delivery that fills the channel (each task of a busy
        # prefork worker): judged every HOLD_LOOK s, HOLD s is what counts.
        if now < self._hold_look_at:
            return
        self._hold_look_at = now + HOLD_LOOK
        # What arrived since the channel filled waits too: given while our acks
        # (held back, see ACK_HOLD) freed room, or just before the credit fell.
        self._learn(consumer_id)
        now = time.monotonic()   # after a listing's round trip, as before the rate limit
        # Full between quick deliveries (a prefork worker's prefetch, in a drain)
        # is no hold: the pace, not the moment, says whether the inbox empties.
        excess = held_back(len(self.buffer) + len(self.pending), self.took, now)
        if not excess:
            self.held_since = None
            return
        if self.held_since is None:
            self.held_since = now
            return
        if now - self.held_since <= HOLD:
            return
        self.held_since = None
        if self.deep:
            self.deep = False
            self._publish_credit()   # sent first: the dispatcher sees it before the freed room
        layout, store = self.transport.layout, self.transport.store
        # Unread ones first, then the buffer's last in the queue's order: what
        # the pace delivers within HOLD stays. They go back in multis
        # (requeue_many; one synced write each stalled this event loop for
        # as many round trips), each dropped here once its fate is known: a
        # failure (ZooKeeper away) leaves the rest here, to deliver or give
        # back later, not stranded. Each stays taken until the watch sees it go.
        unread = list(itertools.islice(self.pending, excess))
        read = self.buffer.latest(excess - len(unread))
        paths = ([layout.inbox_message(self.queue, consumer_id, entry[0]) for entry in unread]
                 + [claimed.owned_path for claimed in read])
        settled: list[str] = []
        try:
            store.requeue_many(paths, settled)
        finally:
            gone = set(settled)
            given = len(gone)
            # The unread given back were the first of pending: put back those not.
            for _ in unread:
                self.pending.popleft()
            self.pending.extendleft(reversed(
                [entry for entry, path in zip(unread, paths) if path not in gone]))
            self.buffer.remove([claimed for claimed in read if claimed.owned_path in gone])
            self._pending_moved()
        logger.debug("celery_zk: gave %d undelivered messages of %s back to the queue",
                     given, self.queue)

    def _learn(self, consumer_id: str) -> None:
        """Start reading what came into the inbox since we last looked."""
        names: list[str] = []
        while self.departures:
            self.taken.discard(self.departures.popleft())
        if self.stale or not self._tree_active():
            self._ensure_watch()
            self.stale = False
            self.arrivals.clear()   # the listing has them
            client = self.transport.handle.client
            path = self._inbox_path()
            try:
                names = client.retry(client.get_children, path)
            except NoNodeError:   # deleted (by hand, or with its queue): make it again
                self._make_inbox(consumer_id)
                self.stale = True
                return
            # What is not there any more was acked or given back.
            self.taken &= set(names)
        # A listing in the queue's order, then what the watch reported, in the
        # order it came (see broker.ready).
        listed, foreign = sort_messages(names)
        names = listed + foreign
        while self.arrivals:
            names.append(self.arrivals.popleft())
        # Once each: an entry made during the listing's round trip is both in the
        # listing and reported by the watch (read twice, it was delivered twice:
        # the nemesis saw a worker run its first 8 messages twice so).
        new = [name for name in dict.fromkeys(names) if name not in self.taken]
        if not new:
            return
        store = self.transport.store
        layout = self.transport.layout
        client = store.client
        to_read: list[tuple[Key, str, str]] = []
        handed = False
        for name in new:
            self.taken.add(name)
            message = parse_message_name(name)
            if message is None:
                logger.error("celery_zk: %r in the inbox of %s is not a message name; "
                             "left there", name, consumer_id)
                continue
            key = self.order.key(message)
            # Named with sequence zero; so is the first message of a bucket (one
            # in bucket_size), which then resets the offers' wait once.
            handed = handed or (message.seq == 0 and not message.requeued)
            to_read.append((key, name, layout.body(self.queue, message)))
        to_read.sort()
        # The bodies in one multiRead per batch, not one request each.
        sent = time.monotonic()
        reads = read_many(client, [path for _, _, path in to_read])
        if to_read:
            first = to_read[0][0]
            if not self.pending or self.pending_first is None or first < self.pending_first:
                self.pending_first = first
        self.pending.extend((name, read, sent, key)
                            for (key, name, _), read in zip(to_read, reads))
        busy = self._in_hand + len(self.buffer) + len(self.pending) >= self._slots
        if not busy:
            self._busy_since = None
        elif self.offer is not None and self.offer.outstanding:
            # Given work for every slot: a message handed over now would wait.
            # Work from the dispatcher (not handed) says the queue has a backlog:
            # withdraw now, and offer later. After the reads: the server answers
            # a session's requests in order, and a delete is a synced write.
            if handed:
                self._withdraw_when_busy()
            else:
                self._offer_after = min(max(self._offer_after * 2, OFFER_AFTER[0]),
                                        OFFER_AFTER[1])
                self._withdraw()
        if handed or not busy:
            # Offers are taken, or the dispatcher's work leaves a slot free (no
            # backlog behind it, a steady trickle): offer at once.
            self._offer_after = 0.0

    def _read_bodies(self, limit: int, block: bool = False) -> None:
        """Move landed reads into the buffer."""
        store = self.transport.store
        client = store.client
        layout = self.transport.layout
        consumer_id = self.consumer_id
        assert consumer_id is not None
        moved = False
        while self.pending and (block or self.pending[0][1].ready()):
            name, read, sent, key = self.pending.popleft()
            block, moved = False, True
            owned = layout.inbox_message(self.queue, consumer_id, name)
            message = parse_message_name(name)
            assert message is not None
            try:
                data, _ = reply_or_retry(client, read, client.get,
                                         layout.body(self.queue, message))
                data = big.read_body(client, layout, self.queue, message, data)
            except (NoNodeError, ChunkMissing):
                self._lost(owned, name)
                continue
            # When the read was sent: the server answered after it (start gates
            # judge freshness by it, however long the message then waits here).
            self.buffer.push(Claimed(self.queue, name, owned, data, sent), key)
        if moved:   # once a batch has landed, not per delivery
            self._pending_moved()

    def _pending_moved(self) -> None:
        self.pending_first = min((entry[3] for entry in self.pending), default=None)

    def look(self, in_hand: int = 0, slots: int = 1) -> None:
        """Before each delivery: start reading what arrived meanwhile, so its
        reads overlap what the buffer still holds, and move what landed. A
        read of a message that goes before everything in the buffer (given
        later, earlier in the queue's order) is waited for: it goes first.
        (``in_hand``, ``slots``: as for :meth:`fill`.)"""
        consumer_id = self.consumer_id
        if consumer_id is None:
            return
        if self.arrivals and not self.stale:
            self._in_hand, self._slots = in_hand, max(1, slots)
            self._learn(consumer_id)
        if not self.pending:
            return
        self._read_bodies(0)
        # With the buffer empty, take() finds nothing and fill() waits instead.
        while (self.pending and self.buffer and self.pending_first is not None
               and self.pending_first < self.buffer.first_key()):  # type: ignore[operator]
            self._read_bodies(0, block=True)

    def _lost(self, owned: str, name: str) -> None:
        """An entry whose body is gone: acked already (a redelivery of our own
        ack's retry), or removed by hand. Nothing to deliver; the entry goes."""
        self.taken.discard(name)
        client = self.transport.store.client
        if client.retry(client.exists, owned) is not None:
            logger.error("celery_zk: the body of %s is missing; the message cannot be "
                         "delivered and is removed", owned)
            try:
                client.retry(client.delete, owned)
            except NoNodeError:
                pass

    def get_one(self) -> Claimed | None:
        """``basic_get``: what is in our inbox already, else the head of the queue,
        claimed by us (racing the dispatcher is harmless: one of us is refused)."""
        consumer_id = self._registered()
        if consumer_id is None:
            return None
        self._learn(consumer_id)
        self._read_bodies(1, block=bool(self.pending))
        if self.buffer:
            return self.take()
        store = self.transport.store
        layout = self.transport.layout
        found = store.listing(self.queue, 1)
        for name in found.names[:8]:
            owned = store.claim_one(self.queue, name, consumer_id)
            if owned is None:
                continue   # taken meanwhile: try the next
            self.taken.add(name)
            message = parse_message_name(name)
            assert message is not None
            sent = time.monotonic()
            try:
                data, _ = store.read_owned(layout.body(self.queue, message))
                data = big.read_body(store.client, layout, self.queue, message, data)
            except (NoNodeError, ChunkMissing):
                self._lost(owned, name)
                continue
            self.delivered.add(name)
            return Claimed(self.queue, name, owned, data, sent)
        return None

    def take(self) -> Claimed | None:
        """The next message to deliver (from :attr:`buffer`)."""
        if not self.buffer:
            return None
        claimed = self.buffer.pop()
        self.delivered.add(claimed.name)
        self.took.append(time.monotonic())
        self._look_in = LOOK_AGAIN[0]
        self._idle_since = None
        if self._look_timer is not None:   # busy again: no look needed
            self._look_timer.cancel()
            self._look_timer, self._look_at = None, 0.0
        return claimed

    def settled(self, name: str) -> None:
        """A delivered message was acked, rejected or requeued. It stays in
        :attr:`taken` until a listing or the watch shows it gone from the
        inbox: an ack is sent a moment later, and a listing meanwhile must not
        deliver it again."""
        self.delivered.discard(name)
        if not self.transport.in_event_loop:
            # A blocking consumer looks at its inbox again only when it next
            # waits: a client waiting for replies (Celery's rpc:// results,
            # remote control's replies) would offer only once it waits for the
            # next one, too late for a reply sent within milliseconds, which
            # then waits for the dispatcher. Offered now, while free.
            self._offer_if_free()

    def _offer_if_free(self) -> None:
        """Offer (see _offer_to_make) if nothing waits to be delivered or read."""
        consumer_id, offer = self.consumer_id, self._offer_to_make()
        if (consumer_id is not None and offer is not None and not self.buffer
                and not self.pending and not self.arrivals):
            offer.make(consumer_id)

    def _tree_active(self) -> bool:
        return self._watching and self.transport.watches.active(self._inbox_path())

    def _inbox_path(self) -> str:
        consumer_id = self.consumer_id
        assert consumer_id is not None
        if self._path[0] != consumer_id:
            self._path = (consumer_id, self.transport.layout.inbox(self.queue, consumer_id))
        return self._path[1]

    def _ensure_watch(self) -> None:
        """Hold the persistent watch on the inbox (added before the listing it covers)."""
        self.transport.watches.watch(self._inbox_path(), self._tree_cb)
        self._watching = True

    def _stop_watch(self) -> None:
        held, self._watching = self._watching, False
        if held and self.consumer_id is not None:
            self.transport.watches.unwatch(self._inbox_path(), self._tree_cb)

    def _withdraw_when_busy(self) -> None:
        """Every slot is taken by handed work: withdraw the offer once that has
        lasted BUSY_GRACE s (looking again then, in an event loop)."""
        now = time.monotonic()
        if self._busy_since is None:
            self._busy_since = now
        left = self._busy_since + BUSY_GRACE - now
        if left <= 0:
            self._withdraw()
            return
        if self._look_timer is not None and self._look_at <= now + left:
            return   # a look is due by then
        timer = self.transport.look_again(left)
        if timer is None:   # no event loop to come back to us: now
            self._withdraw()
            return
        if self._look_timer is not None:   # due later: this look does its work too
            self._look_timer.cancel()
        self._look_timer, self._look_at = timer, now + left

    def _withdraw(self, wait: bool = False) -> None:
        """Withdraw our offer; ``wait`` until it is deleted (when we stop: nothing
        may be handed to us after that)."""
        if self.offer is None or not self.offer.outstanding:
            return
        try:
            self.offer.withdraw(wait)
        except CONNECTION_ERRORS as exc:   # redone in the background (see Offer.withdraw)
            log_failure(logger, exc, "celery_zk: could not withdraw the offer on %s now; "
                        "retrying in the background", self.queue)

    def close(self) -> None:
        """Stop being given work, and give back what was given and not delivered
        (what was delivered is settled by the channel's QoS)."""
        transport = self.transport
        consumer_id, node = self.consumer_id, self.node
        self.node = None
        self._withdraw(wait=True)
        self._stop_watch()
        if consumer_id is not None:
            self._dispatcher().leave(consumer_id)
        if consumer_id is None or not transport.handle.started:
            return
        # Not given to kombu: never read, or read and not delivered. What was
        # delivered is the channel's to settle (acked, or restored by its QoS).
        undelivered = {c.name for c in self.buffer} | {entry[0] for entry in self.pending}
        keep = set(self.delivered)
        handed = set(self.taken) - undelivered   # given to kombu (acked or not)
        self.pending.clear()
        self.pending_first = None
        self.buffer.clear()
        self.taken = set(keep)
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
        """Leave the queue's consumers/ (the dispatcher gives nothing after
        that), then requeue every entry of the inbox but those ``handed`` to
        kombu (acked, or the channel's to settle); the inbox goes too unless
        ``keep`` (delivered and not settled) still has entries in it."""
        transport = self.transport
        store, client = transport.store, transport.handle.client
        if node is not None:
            try:
                client.retry(client.delete, node)
            except NoNodeError:
                pass
            transport.handle.disown(node)
        inbox = transport.layout.inbox(self.queue, consumer_id)
        try:
            names = client.retry(client.get_children, inbox)
        except NoNodeError:
            return
        store.requeue_many([transport.layout.inbox_message(self.queue, consumer_id, name)
                            for name in names if name not in handed and name not in keep])
        if not keep:
            try:   # refused while a delivered message waits for its ack
                client.retry(client.delete, inbox)
            except (NoNodeError, NotEmptyError):
                pass


def _give_back_again(item: tuple[Inbox, str, str | None, set[str], set[str]]) -> None:
    inbox, consumer_id, node, read, keep = item
    try:
        inbox._give_back(consumer_id, node, read, keep)
    except Exception as exc:   # the session's end gives them back (recovery)
        log_failure(logger, exc, "celery_zk: could not give back the undelivered messages "
                    "of %s; they go back when this worker's session ends", inbox.queue)


#: Give-backs that could not reach ZooKeeper, redone in order once it answers.
_give_backs: RedoThread[tuple[Inbox, str, str | None, set[str], set[str]]] = RedoThread(
    "celery_zk-give-back", _give_back_again)
