"""One connection's consumption of one queue: its inbox, ``owned/{consumer}/``,
filled by the queue's dispatcher and by publishers' hand-offs. How much it may
hold is :mod:`celery_zk.broker.credit`; when to offer,
:mod:`celery_zk.broker.offer`.

Only this consumer deletes from its inbox, so its acks never conflict. Watch
callbacks only record what happened and wake the transport; every request is
made from the consuming thread (one made on kazoo's connection thread can
block it for good). See ``docs/design.md``, "Waiting: watches, not polling".
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss, NodeExistsError, NoNodeError

from ..exceptions import ChunkMissing
from ..zk.client import (
    CONNECTION_ERRORS,
    delete_if_there,
    multi_failure,
    reply_or_retry,
    synced,
)
from ..zk.message_names import inline_body, parse_message_name, slot_of, sort_messages
from ..zk.reads import read_many
from ..zk.session import weak_callback
from ..zk.watches import NODE_CREATED, NODE_DELETED
from . import big
from .credit import Credit
from .membership import Membership
from .offer import Offer
from .ready import Claimed, DeliveryOrder, Key, Ready

if TYPE_CHECKING:   # the protocol's module imports nothing of ours that imports this one
    from .connection import ZKConnection

__all__ = ["Inbox"]

logger = logging.getLogger(__name__)


class Inbox:
    """One connection's inbox on one queue, shared by its channels."""

    def __init__(self, transport: ZKConnection, queue: str) -> None:
        self.transport = transport
        self.queue = queue
        self.options = transport.settings.options
        self.consumer_id: str | None = None   # the registration the inbox belongs to
        self.member = Membership(transport, queue)
        self.policy = Credit(self.options.lookahead)
        self.consuming = 0                    # channels consuming it
        self.taken: set[str] = set()          # entries read or being read (not to take twice)
        self.delivered: set[str] = set()      # entries handed to kombu, not yet settled
        # (name, read, when the read was sent, its key) in delivery order
        self.pending: deque[tuple[str, Any, float, Key]] = deque()
        self.pending_first: Key | None = None   # the first of them in delivery order
        self.buffer = Ready()                 # read, not delivered yet
        self.order = DeliveryOrder()          # where what arrives goes (see broker.ready)
        self.arrivals: deque[str] = deque()   # names the tree watch reported
        self.heard_at = 0.0   # when the watch last reported an arrival (monotonic)
        self.departures: deque[str] = deque()   # and those it saw go
        self.stale = True   # list the inbox before trusting the watch
        self._watching = False   # our watch on the inbox was added
        self.offer = (Offer(transport.handoff, queue, transport.look_again)
                      if transport.handoff is not None else None)
        # What the last fill was told: tasks in hand, and how many run at once.
        self._in_hand, self._slots = 0, 1
        # Our inbox's path (for consumer_id): looked up on every turn of the
        # consuming loop, so kept.
        self._path: tuple[str | None, str] = (None, "")
        self._tree_cb = weak_callback(self._on_tree)

    # -- kazoo's threads: record and wake -------------------------------------
    def _on_tree(self, event_type: int, name: str) -> None:
        if event_type == NODE_CREATED and name and "/" not in name:
            self.heard_at = time.monotonic()   # the server spoke: see _learn
            self.arrivals.append(name)
            self.transport.wake()
        elif event_type == NODE_DELETED and "/" not in name:
            if name:
                self.departures.append(name)   # acked or given back: forget it
            else:
                self.reset()   # the inbox itself, by hand: made again at the next look

    def reset(self) -> None:
        """List again: after a connection or session change, or the inbox's deletion."""
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
            if self.member.node is None:
                self.member.join(consumer_id)
            self.member.dispatcher().watch()   # a flag check, unless the election needs a look
        return consumer_id

    def _new_identity(self, consumer_id: str) -> bool:
        """A new registration (first use, or after the session expired): what the
        old inbox held is the recovery leader's now. False when there is no
        queue to make our inbox in (yet)."""
        if not self.member.make_inbox(consumer_id):
            return False
        old = self.consumer_id
        self.consumer_id = consumer_id
        self.member.node = None
        self.taken.clear()
        self.delivered.clear()
        self.pending.clear()
        self.pending_first = None
        self.buffer.clear()
        self.arrivals.clear()
        self.stale = True
        self._stop_watch()
        if old is not None:
            self.member.dispatcher().leave(old)
        return True

    def set_credit(self, prefetch: int) -> None:
        """The consuming channels' prefetch, which sets what the dispatcher may put
        in our inbox (more with the lookahead)."""
        self.policy.set_prefetch(prefetch)
        self.member.write_credit(self.policy.value)

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

    def stop(self) -> None:
        """A channel stops consuming the queue; the last one out leaves the
        queue's consumers/ and gives back what it was given and did not deliver."""
        self.consuming = max(0, self.consuming - 1)
        if self.consuming:
            return
        self.close()

    # -- the consuming thread -------------------------------------------------------
    def fill(self, in_hand: int, slots: int = 1) -> None:
        """Make what the inbox holds ready in :attr:`buffer` (``in_hand``:
        delivered and not done with; ``slots``: how many the worker runs at once)."""
        consumer_id = self._registered()
        if consumer_id is None:
            return
        self.policy.taking()
        self._in_hand, self._slots = in_hand, max(1, slots)
        self._learn(consumer_id)
        self._read_bodies()
        self.transport.acks.running_low(self._inbox_path(), len(self.buffer) + len(self.pending),
                                        self.member.credit or self.options.claim_batch)
        if self.buffer:
            return
        if self.pending:
            # The first read has not landed: wait for it (the others were sent with it).
            self._read_bodies(block=True)
            return
        self.policy.dry()
        self.member.write_credit(self.policy.value)
        if self.offer is not None:
            self.offer.dry(consumer_id, in_hand, self._slots, self._may_offer())

    def _may_offer(self) -> bool:
        """Consuming, fewer delivered and not settled than the worker's slots,
        and the inbox's watch held (what is handed over is heard of)."""
        return bool(self.consuming and len(self.delivered) < self._slots and self._watching)

    def full(self) -> None:
        """The channel takes nothing now (its prefetch is full): no offer, and
        what the credit policy says would wait too long goes back to the queue
        (see :mod:`celery_zk.broker.credit`)."""
        consumer_id = self._registered()
        if consumer_id is None:
            return
        if self.offer is not None:
            self.offer.withdraw(wait=False)
        if not self.policy.hold_due():
            return
        # What arrived since the channel filled waits too: given while our acks
        # (held back, see ACK_HOLD) freed room, or just before the credit fell.
        self._learn(consumer_id)
        excess = self.policy.excess(len(self.buffer) + len(self.pending))
        if not excess:
            return
        # Sent first: the dispatcher sees it before the freed room.
        self.member.write_credit(self.policy.value)
        layout, acks = self.transport.layout, self.transport.acks
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
            acks.requeue_many(paths, settled)
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
                self.member.make_inbox(consumer_id)
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
        layout = self.transport.layout
        client = self.transport.handle.client
        to_read: list[tuple[Key, str, str]] = []
        handed = False
        for name in new:
            self.taken.add(name)
            message = parse_message_name(name)
            if message is None:
                if slot_of(name) is None:   # a slot is a running task's (broker.slots)
                    logger.error("celery_zk: %r in the inbox of %s is not a message "
                                 "name; left there", name, consumer_id)
                continue
            key = self.order.key(message)
            # Named with sequence zero; so is the first message of a bucket (one
            # in bucket_size), which then resets the offers' wait once.
            handed = handed or (message.seq == 0 and not message.requeued)
            body = inline_body(name)
            if body is not None:
                # Handed over with a copy of its body in its name: nothing to
                # read. The server last spoke to us when the latest event came.
                self.buffer.push(Claimed(self.queue, name,
                                         layout.inbox_message(self.queue, consumer_id, name),
                                         body, self.heard_at), key)
                continue
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
        if self.offer is not None:
            self.offer.given(handed, self._in_hand + len(self.buffer) + len(self.pending)
                             >= self._slots)

    def _read_bodies(self, block: bool = False) -> None:
        """Move landed reads into the buffer."""
        layout = self.transport.layout
        consumer_id = self.consumer_id
        assert consumer_id is not None
        moved = False
        while self.pending and (block or self.pending[0][1].ready()):
            name, read, sent, key = self.pending.popleft()
            block, moved = False, True
            owned = layout.inbox_message(self.queue, consumer_id, name)
            claimed = self._claimed(name, owned, sent, read)
            if claimed is not None:
                self.buffer.push(claimed, key)
        if moved:   # once a batch has landed, not per delivery
            self._pending_moved()

    def _claimed(self, name: str, owned: str, sent: float, read: Any = None) -> Claimed | None:
        """The message with its body (``read``: its read's reply, else read now),
        None if that is gone. ``sent``, when the read was sent, is when it was
        seen (start gates judge freshness by it, however long it waits here)."""
        layout, client = self.transport.layout, self.transport.handle.client
        message = parse_message_name(name)
        assert message is not None
        path = layout.body(self.queue, message)
        try:
            data, stat = (client.retry(client.get, path) if read is None
                          else reply_or_retry(client, read, client.get, path))
            data = big.read_body(client, layout, self.queue, message, data)
        except (NoNodeError, ChunkMissing):
            self._lost(owned, name)
            return None
        return Claimed(self.queue, name, owned, data, sent, stat.ctime / 1e3)

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
        self._read_bodies()
        # With the buffer empty, take() finds nothing and fill() waits instead.
        while (self.pending and self.buffer and self.pending_first is not None
               and self.pending_first < self.buffer.first_key()):  # type: ignore[operator]
            self._read_bodies(block=True)

    def _lost(self, owned: str, name: str) -> None:
        """An entry whose body is gone: acked already (a redelivery of our own
        ack's retry), or removed by hand. Nothing to deliver; the entry goes."""
        self.taken.discard(name)
        client = self.transport.handle.client
        if client.retry(client.exists, owned) is not None:
            logger.error("celery_zk: the body of %s is missing; the message cannot be "
                         "delivered and is removed", owned)
            delete_if_there(client, owned)

    def get_one(self) -> Claimed | None:
        """``basic_get``: what is in our inbox already, else the head of the queue,
        claimed by us (racing the dispatcher is harmless: one of us is refused)."""
        consumer_id = self._registered()
        if consumer_id is None:
            return None
        self._learn(consumer_id)
        self._read_bodies(block=bool(self.pending))
        if self.buffer:
            return self.take()
        transport = self.transport
        client = transport.handle.client
        for name in transport.queues.listing(self.queue, 1).names[:8]:
            owned = self._claim(client, name, consumer_id)
            if owned is None:
                continue   # taken meanwhile: try the next
            self.taken.add(name)
            claimed = self._claimed(name, owned, time.monotonic())
            if claimed is not None:
                self.delivered.add(name)
                return claimed
        return None

    def _claim(self, client: KazooClient, name: str, consumer_id: str) -> str | None:
        """Move one waiting message into our own inbox; its owned path, or None
        when another consumer (or the dispatcher) took it first."""
        layout = self.transport.layout
        owned = layout.inbox_message(self.queue, consumer_id, name)
        txn = client.transaction()
        # One multi: a crash between the two would lose the message or give it twice.
        txn.delete(layout.unowned_message(self.queue, name))
        txn.create(owned)
        try:
            results = txn.commit()
        except ConnectionLoss:
            # Did it commit? The create tells (the multi is all or nothing).
            synced(client, owned)
            return owned if client.retry(client.exists, owned) is not None else None
        failure = multi_failure(results)
        if failure is None:
            return owned
        if isinstance(failure[1], (NoNodeError, NodeExistsError)):
            return None
        raise failure[1]

    def take(self) -> Claimed | None:
        """The next message to deliver (from :attr:`buffer`)."""
        if not self.buffer:
            return None
        claimed = self.buffer.pop()
        self.delivered.add(claimed.name)
        self.policy.delivered()
        if self.offer is not None:
            self.offer.delivering()
        return claimed

    @property
    def has_news(self) -> bool:
        """Something arrived, or waits to be read or delivered: worth a look now."""
        return bool(self.arrivals or self.pending or self.buffer)

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
        """Offer if nothing waits to be delivered or read."""
        consumer_id, offer = self.consumer_id, self.offer
        if (consumer_id is not None and offer is not None and not offer.outstanding
                and self._may_offer() and not self.has_news):
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

    def close(self) -> None:
        """Stop being given work, and give back what was given and not delivered
        (what was delivered is settled by the channel's QoS)."""
        if self.offer is not None:
            self.offer.withdraw(wait=True)
        self._stop_watch()
        # Not given to kombu: never read, or read and not delivered. What was
        # delivered is the channel's to settle (acked, or restored by its QoS).
        undelivered = {c.name for c in self.buffer} | {entry[0] for entry in self.pending}
        keep = set(self.delivered)
        handed = set(self.taken) - undelivered   # given to kombu (acked or not)
        self.pending.clear()
        self.pending_first = None
        self.buffer.clear()
        self.taken = set(keep)
        self.member.leave(self.consumer_id, handed, keep)
