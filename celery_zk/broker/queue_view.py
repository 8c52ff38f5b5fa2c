"""What one channel knows about one queue it consumes, and how it learns more.

A consumer claims from a cached, sorted listing of the queue's ``unowned/``
directory, re-read when used up or older than ``listing_max_age``, so a busy
backlog is not listed per message. When a listing comes back empty the view
is *armed*: it sends ZooKeeper nothing until a watch reports a change.

Which watch depends on how busy the queue is:

* **Idle** (the last listing was empty): a persistent recursive watch on
  ``unowned/`` (:mod:`celery_zk.zk.watches`). Each new message arrives with its
  name, so the consumer claims it without listing the directory again: one
  request less on every idle round trip. The watch is added *before* the
  listing that finds the queue empty, so no message falls between the two.
* **Busy** (a listing held more than ``claim_batch`` messages, or more than
  that arrived unclaimed): the persistent watch is removed, because it would
  send every consumer a notification for every message created and claimed;
  a one-shot child watch, set by each listing, is enough while there is a
  backlog to work through.

When persistent watches are off (option ``persistent_watches``, or a server
before 3.6) every listing sets a one-shot child watch, and a woken consumer
lists the queue.

An idle view that may take more also leaves an *offer* (:mod:`celery_zk.broker.handoff`)
and watches ``owned/`` the same way: a publisher that sees the offer creates
the message there, in this consumer's name, and the view delivers it without
a claim. Handed messages and arrivals are delivered in the order their watch
events came, so one publisher's messages keep their order.

When the listing holds messages with affinity keys, the view chooses among
them by :func:`celery_zk.features.locality.choose`. If it may take none yet (their
keys are held by other workers and have not waited ``locality_wait``, or a key
it started on is not yet held), it
is *deferring*: it lists again on the next watch event, and a timer wakes
it when the first of them may be taken.

Watch callbacks only record what happened and wake the transport; every
request is made from the consuming thread. The tree callbacks run on kazoo's
connection thread itself (celery_zk.zk.watches), where even a request that does
not wait can block: kazoo wakes that thread through a socket only it drains,
and a burst of other threads' requests fills it.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from itertools import islice
from time import monotonic
from typing import TYPE_CHECKING, Any

from kazoo.exceptions import NoNodeError

from ..features.locality import Waiting, choose
from ..zk.client import CONNECTION_ERRORS, log_failure, reply_or_retry
from ..zk.layout import parse_bucket_name, parse_message_name, sort_messages, split_owned_name
from ..zk.session import weak_callback
from ..zk.watches import NODE_CREATED
from .handoff import Offer
from .queue import Claimed, PendingClaim

if TYPE_CHECKING:   # the protocol's module imports nothing of ours that imports this one
    from .connection import ZKConnection

__all__ = ["QueueView"]

logger = logging.getLogger(__name__)


class QueueView:
    """One channel's consumer state for one queue."""

    def __init__(self, transport: ZKConnection, queue: str) -> None:
        self.transport = transport
        self.queue = queue
        self.path = transport.layout.unowned(queue)
        self.owned_path = transport.layout.owned(queue)
        self.options = transport.settings.options
        self.listing: deque[str] = deque()   # sorted, not yet tried
        self.listed_at = 0.0
        self.buffer: deque[Claimed] = deque()   # claimed, not delivered yet
        self.ahead: deque[PendingClaim] = deque()   # claims sent, not yet come back
        self.armed = False    # empty at last look, and no watch has fired since
        self.events = 0       # bumped by every watch; detects a fire during a listing
        self.idle = True      # the last listing was empty: the next one adds the tree watch
        self.stale = False    # the tree watch may have missed something: list next time
        self.arrivals: deque[tuple[int, str]] = deque()   # (order, name) the tree watch reported
        self.reads: dict[str, Any] = {}   # arrivals whose read an idle view started at once
        # (order, owned name, read under way): messages handed to us, ours to deliver.
        self.handed: deque[tuple[int, str, Any]] = deque()
        self.order = 0        # watch events so far: orders arrivals against hand-offs
        self.consuming = False   # the channel consumes this queue (a basic_get view never offers)
        self.offer = Offer(transport.handoff, queue) if transport.handoff is not None else None
        self.closed = False
        self.keyed = False    # the listing holds messages with affinity keys
        self.waiting = Waiting()   # what the affinity choice remembers
        self._in_hand = 0   # delivered and not done with, at the last fill
        self.deferring: int | None = None   # nothing to take yet: events at that look
        self._retry_in: float | None = None   # from the last choice: when one may be taken
        self._timer: threading.Timer | None = None
        self._timer_due = 0.0
        self._tree_held = False   # our _on_tree is registered with the tree watch
        self._owned_held = False   # our _on_owned is registered with the owned/ watch
        # What kazoo and the session's tree watches hold: weak, so a connection
        # dropped without close() is not kept alive by a watch that never fires.
        self._one_shot_cb = weak_callback(self._on_one_shot)
        self._tree_cb = weak_callback(self._on_tree)
        self._owned_cb = weak_callback(self._on_owned)

    # -- kazoo threads: record and wake, nothing else ---------------------------
    def _woken(self) -> None:
        self.events += 1
        self.armed = False
        if not self.closed:
            self.transport.wake()

    def _on_one_shot(self, _event: Any) -> None:
        self._woken()

    def _on_tree(self, event_type: int, path: str) -> None:
        # path is relative to unowned/: "bucket/message", a bucket, or a flat
        # message of a publisher from before buckets.
        bucket, _, name = path.rpartition("/")
        if bucket and "/" in bucket:
            return   # below a message node: not ours
        if not bucket and parse_bucket_name(name) is not None:
            return   # a bucket made or deleted: no message came with it
        if name:
            if event_type != NODE_CREATED:
                return   # a claim or purge: nothing new to take, no need to wake
            message = parse_message_name(name)
            if message is None or message.bucket != (bucket or None):
                name = path   # foreign: the listing dead-letters it by its path
            if len(self.arrivals) >= self.options.claim_batch:
                self.stale = True   # a backlog builds up: the next look lists (and goes busy)
                self.arrivals.clear()
                self.reads.clear()
            else:
                # No read from here: this runs on kazoo's connection thread, and a
                # request made on it can block on kazoo's wake-up socket when
                # other threads have filled it, which only this thread drains (a
                # deadlock seen with a 1,000-task chord header). The consuming
                # thread reads it when it wakes.
                self.order += 1
                self.arrivals.append((self.order, name))
        else:
            self.stale = True   # unowned/ itself was deleted or created (queue re-declared)
        self._woken()

    def _on_owned(self, event_type: int, name: str) -> None:
        if event_type != NODE_CREATED or not name or "/" in name or self.offer is None:
            return
        parts = split_owned_name(name)
        message = parse_message_name(parts[1]) if parts is not None else None
        if parts is None or message is None or not self.offer.taken(parts[0], message.uid):
            return   # someone's claim, or not handed in answer to our offer
        self.order += 1
        self.handed.append((self.order, name, None))   # read when delivered (see _on_tree)
        self._woken()

    # -- the consuming thread ---------------------------------------------------
    def reset(self) -> None:
        """After a connection or session change: watches may be gone, so look again.

        Runs on kazoo's thread (a session event), so it only flags: the
        consuming thread may be iterating the listing, and it lists again
        before its next pick anyway (``stale``)."""
        self.stale = True
        self._woken()

    def invalidate(self) -> None:
        """The listing is out of date (a requeue sorts ahead of it, a purge emptied it).

        A threads worker rejects (and so requeues) on a pool thread while the
        consuming thread may be iterating the listing: only flag, as reset()."""
        self.stale = True
        self.armed = False

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._stop_tree()

    def fill(self, limit: int, in_hand: int = 0) -> None:
        """Claim up to ``limit`` messages into :attr:`buffer`, if any are waiting
        (``in_hand``: messages the channel delivered that are not done with)."""
        self._in_hand = in_hand
        if self._handed_next():
            self._take_handed(limit)
            return
        if self.armed:
            return   # empty at last look and nothing changed since: no request needed
        if limit <= 0:
            self.withdraw()
            if self.stale and self._tree_held:
                self._stop_tree()   # arrivals overflow while we cannot take any: busy
            return
        transport = self.transport
        consumer_id, _ = transport.session.ensure_registered()
        if self.stale:
            self.withdraw()   # a reconnect may have hidden a hand-off from the watch
        while True:
            if not self.listing and not self.stale and self._tree_active():
                if not self._take_arrivals():
                    self._make_offer(limit)
                    return
            elif (not self.listing or self.stale
                  or (self.deferring is not None and self.deferring != self.events)
                  or monotonic() - self.listed_at > self.options.listing_max_age):
                if not self._list():
                    self._make_offer(limit)
                    return
            if not self.listing:
                continue   # only foreign names arrived
            batch = self._pick(limit)   # removes the batch from the listing
            if not batch:
                self._defer()
                return
            if self.consuming and not self.idle:
                self._claim_async(batch, consumer_id)
                return   # the event loop delivers it when it lands (see collect)
            claimed, gone = transport.store.claim(self.queue, batch, consumer_id, self.reads)
            # Names neither claimed nor gone did not fit in one request: next time.
            taken = gone.union(message.name for message in claimed)
            self.listing.extendleft(reversed([name for name in batch if name not in taken]))
            if claimed:
                self._buffer(claimed, limit)
                return

    def _tree_active(self) -> bool:
        watches = self.transport.watches
        return self._tree_held and watches is not None and watches.active(self.path)

    def _take_arrivals(self) -> bool:
        """Use what the tree watch reported as the listing; False when nothing came."""
        generation = self.events
        names = []
        while self.arrivals and not self._handed_next():   # those before the next hand-off
            try:
                names.append(self.arrivals.popleft()[1])
            except IndexError:   # cleared meanwhile by an overflow: the view lists
                break
        if not names:
            self.armed = self.events == generation
            return False
        self._use_listing(names)
        self.listed_at = monotonic()   # as complete as a listing: nothing else is new
        return True

    def _defer(self) -> None:
        """Every message listed waits for another worker that holds its key:
        look again on the next event, or when the first may be taken."""
        self.deferring = self.events
        delay = self._retry_in
        if delay is None:
            return
        due = monotonic() + delay
        if self._timer is not None and self._timer.is_alive() and self._timer_due <= due:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_due = due
        self._timer = threading.Timer(delay + 0.001, self._woken)
        self._timer.daemon = True
        self._timer.start()

    def _set_listing(self, names: list[str]) -> None:
        self.listing = deque(names)
        self.deferring = None
        self.keyed = any("@" in name for name in names)

    def _list(self) -> bool:
        """List the queue; False when it is empty (then the view is armed)."""
        tree = self._ensure_tree()
        generation = self.events
        self.stale = False
        self.arrivals.clear()   # whatever arrived so far is in this listing
        self.reads.clear()
        found = self.transport.store.listing(
            self.queue, self.options.claim_batch, watch=None if tree else self._one_shot_cb)
        self._dead_letter(found.foreign)
        names = found.names
        self._set_listing(names)
        if self.waiting.seen:   # forget the messages that went
            self.waiting.forget(set(names))
        self.listed_at = monotonic()
        self.idle = not names
        if tree and len(names) > self.options.claim_batch:
            self._stop_tree()   # busy: stop the notification per message
        if not names:
            self.armed = self.events == generation
            return False
        return True

    def _ensure_tree(self) -> bool:
        """Hold the tree watch when idle (added before the listing it covers)."""
        watches = self.transport.watches
        if watches is None or not watches.supported:
            return False
        if not self._tree_held and not self.idle:
            return False
        self._tree_held = watches.watch(self.path, self._tree_cb)
        if self._tree_held and self.offer is not None:
            self._owned_held = watches.watch(self.owned_path, self._owned_cb)
        return self._tree_held

    def _stop_tree(self) -> None:
        held, self._tree_held = self._tree_held, False
        owned, self._owned_held = self._owned_held, False
        watches = self.transport.watches
        if owned and watches is not None:
            watches.unwatch(self.owned_path, self._owned_cb)
        self.withdraw()   # after the watch went: a hand-off meanwhile is found by this
        if held and watches is not None:
            self.arrivals.clear()
            self.reads.clear()
            if watches.unwatch(self.path, self._tree_cb):
                # That also removed any one-shot watch this client held on the
                # path (another channel's): make those look again.
                self.transport.watch_removed(self.queue, self)

    # -- hand-off ---------------------------------------------------------------
    def _handed_next(self) -> bool:
        """True when a handed message is next in event order (kazoo's thread may
        append to, or clear, the deques meanwhile)."""
        try:
            handed = self.handed[0][0]
        except IndexError:
            return False
        try:
            return handed < self.arrivals[0][0]
        except IndexError:
            return True

    def _make_offer(self, capacity: int) -> None:
        """Offer to take the next message directly, when idle and able to take one."""
        offer, watches = self.offer, self.transport.watches
        if (offer is None or offer.outstanding or not self.consuming or capacity <= 0
                or self.closed or self.arrivals or self.stale or watches is None
                or not self._tree_active() or not self._owned_held
                or not watches.active(self.owned_path)):
            return
        consumer_id, _ = self.transport.session.ensure_registered()
        offer.make(consumer_id)

    def _take_handed(self, limit: int) -> None:
        """Move the messages handed to us (up to the next arrival) into the buffer."""
        while self._handed_next():
            _, name, read = self.handed[0]
            self._keep(self.transport.layout.owned_message(self.queue, name), read)
            self.handed.popleft()
        # Still idle: offer again now, so the next message can be handed over
        # while this one is processed.
        self._make_offer(limit - len(self.buffer))

    def withdraw(self) -> None:
        """Withdraw our offer; keep the message a publisher handed over first."""
        if self.offer is None or not self.offer.outstanding:
            return
        try:
            found = self.offer.withdraw()
        except CONNECTION_ERRORS as exc:   # redone in the background (see Offer.withdraw)
            log_failure(logger, exc, "celery_zk: could not withdraw the offer on %s now; "
                        "retrying in the background", self.queue)
            return
        if found is None:
            return
        consumer_id, path = found
        if consumer_id != self.transport.session.consumer_id:
            return   # made by an ended session: the recovery leader requeues it
        self._keep(path)

    def _keep(self, path: str, read: Any = None) -> None:
        """Buffer a message handed over to us (``read``: its read, if under way)."""
        store = self.transport.store
        try:
            data, _stat = (store.read_owned(path) if read is None
                           else reply_or_retry(store.client, read, store.client.get, path))
        except NoNodeError:
            return   # our session ended and the recovery leader requeued it
        name = self.transport.layout.split_owned_path(path)[2]
        self.buffer.append(Claimed(self.queue, name, path, data))

    def _use_listing(self, names: list[str]) -> None:
        ordered, foreign = sort_messages(names)
        self._dead_letter(foreign)
        self._set_listing(ordered)

    def _dead_letter(self, foreign: list[str]) -> None:
        for name in foreign:
            self.reads.pop(name, None)
            self.transport.store.dead_letter_unowned(
                self.queue, name, "node name was not written by celery_zk")

    @property
    def claiming(self) -> int:
        """Messages in claims sent and not yet come back (they hold prefetch slots)."""
        return sum(len(pending.candidates) for pending in self.ahead)

    def _claim_async(self, batch: list[str], consumer_id: str) -> None:
        """Claim ``batch`` from a backlog without waiting on the consuming thread.

        A draining consumer otherwise waits for every read and every claim's
        commit while its pool runs out of work. Here the claim is sent once its
        reads have landed (else the reads are started, the batch goes back to
        the listing, and the consumer is woken when they land); the event loop
        goes on meanwhile, and a prefetch slot freed meanwhile starts the next
        claim. Claims land in the order they were sent (one session's requests
        are answered in order) and are delivered in that order.
        """
        transport = self.transport
        store = transport.store
        try:
            for name in batch:
                if name not in self.reads:
                    self.reads[name] = store.read_async(self.queue, name)
            pending = store.claim_async(self.queue, batch, consumer_id, self.reads)
        except CONNECTION_ERRORS:
            self.listing.extendleft(reversed(batch))
            raise
        if pending is None:
            self.listing.extendleft(reversed(batch))
            last = self.reads.get(batch[-1])
            if last is None:
                transport.wake()   # the reads were dropped meanwhile (a new listing)
            else:
                last.rawlink(lambda _: transport.wake())
            return
        self.ahead.append(pending)
        if pending.result is None:
            transport.wake()
        else:
            pending.result.rawlink(lambda _: transport.wake())

    def collect(self, block: bool = False) -> None:
        """Move what the claims sent took into the buffer, oldest first, as long
        as they have landed (``block``: wait for all of them)."""
        store = self.transport.store
        while self.ahead and (block or self.ahead[0].ready()):
            claimed, leftover = store.finish_claim(self.ahead.popleft())
            self.listing.extendleft(reversed(leftover))
            if claimed:
                self._buffer(claimed, len(claimed))

    def _buffer(self, claimed: list[Claimed], batch: int) -> None:
        """Buffer what a claim took, and read the next two batches ahead when
        its messages were small (what the reads hold stays small)."""
        self.buffer.extend(claimed)
        if 2 * sum(len(message.data) for message in claimed) <= self.options.max_message_size:
            self._read_ahead(2 * batch)

    def _read_ahead(self, limit: int) -> None:
        """Start reading the batches the next claims will take, while this one is
        delivered. ZooKeeper answers a session's requests in order, so reads
        sent with the claim wait behind the acks and claims before them: a
        draining worker spent half its time waiting for them. A read takes
        nothing: if another consumer claims the message first, the claim finds
        it gone, as it would anyway."""
        store = self.transport.store
        for name in self._peek(limit, claim=False):
            if name not in self.reads:
                try:
                    self.reads[name] = store.read_async(self.queue, name)
                except CONNECTION_ERRORS:
                    return   # the claim reads (or reports) itself

    def _peek(self, limit: int, claim: bool = True) -> list[str]:
        """The batch to claim next, in delivery order: the head, one consumer's
        slice of it, or the affinity choice (:func:`celery_zk.features.locality.choose`;
        ``claim=False``: only a look, to read ahead).

        Consumers sharing a backlog would all try the same head and abort each
        other's transactions; on a long first priority level each takes its own
        slice instead (order across consumers is not defined anyway). Looks at
        no more than it needs: the listing can hold a large backlog.
        """
        listing = self.listing
        session = self.transport.session
        ids = session.live_ids()
        place = ids.index(session.consumer_id) if session.consumer_id in ids else 0
        offset = place * limit if len(ids) > 1 else 0
        self._retry_in = None
        if self.keyed:
            board = self.transport.affinity
            board.refresh()
            idle = not (self._in_hand or self.buffer or self.ahead)
            # A read-ahead's look must not count as starting on a key.
            waiting = self.waiting if claim else self.waiting.look()
            batch, self._retry_in = choose(listing, limit, board, waiting,
                                           self.options.locality_wait, index=place, idle=idle)
            return batch
        if offset:
            window = list(islice(listing, 0, offset + limit))
            head = parse_message_name(window[0]) if window else None
            tail = parse_message_name(window[-1]) if window else None
            if (len(window) == offset + limit and head is not None and tail is not None
                    and head.inverted_priority == tail.inverted_priority):
                return window[offset:]   # one priority level: spread out
        return list(islice(listing, 0, limit))

    def _pick(self, limit: int) -> list[str]:
        """Take the batch to claim (:meth:`_peek`) off the listing."""
        batch = self._peek(limit)
        listing = self.listing
        taken = set(batch)
        skipped = []
        while taken and listing:   # every name of the batch is in the listing, in its order
            name = listing.popleft()
            if name in taken:
                taken.discard(name)
            else:
                skipped.append(name)
        listing.extendleft(reversed(skipped))
        return batch
