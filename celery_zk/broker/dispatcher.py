"""One dispatcher per queue: the thread, in the process of the queue's first
consumer node, that alone lists its waiting messages and gives them to its
consumers' inboxes.

Watch callbacks (kazoo's threads) only record what happened and wake the
dispatcher's thread, which makes the requests. Nothing may rest on there
being exactly one dispatcher: each assignment deletes the name it gives, so
two that overlap cost a refused multi.
See ``docs/design.md``, "One dispatcher per queue".
"""
from __future__ import annotations

import json
import logging
import threading
from collections import deque
from collections.abc import Callable
from time import monotonic
from typing import Any

from kazoo.exceptions import ConnectionLoss, NoNodeError

from ..zk.client import CONNECTION_ERRORS, answered, json_object, log_failure
from ..zk.config import ZKOptions
from ..zk.layout import Layout
from ..zk.message_names import is_legacy, parse_message_name
from ..zk.names import parse_queue_consumer
from ..zk.session import SharedSession, weak_callback
from ..zk.watches import NODE_CREATED, NODE_DELETED, watches_of
from . import big
from .acks import Acks
from .assignment import Consumer, Head, Planner, assignment, settle
from .delayed import Delayed
from .queues import Queues

__all__ = ["Dispatcher"]

logger = logging.getLogger(__name__)

#: Seconds between sweeps of empty bodies' buckets and orphaned chunks.
SWEEP_EVERY = 60.0


class Dispatcher:
    """The dispatch duty for one queue in this process (see module docstring)."""

    def __init__(self, session: SharedSession, layout: Layout, options: ZKOptions,
                 queue: str) -> None:
        self.session = session
        self.layout = layout
        self.options = options
        self.queue = queue
        self.queues = Queues(session, layout, options)
        self.acks = Acks(self.queues)
        # Consumer ids of this process on the queue, and how to wake each one's thread.
        self.members: dict[str, Callable[[], None]] = {}
        self.live: list[str] = []        # every consumer id on the queue, first joined first
        self.nodes: dict[str, str] = {}  # consumer id -> its node's name under consumers/
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stale_election = True
        self._stopped = False
        # Recorded by watch callbacks (kazoo's threads), applied by our thread.
        self._arrivals: deque[tuple[int, str]] = deque()
        self._inbox_events: deque[tuple[int, str]] = deque()
        self._stale_listing = True
        self._stale_consumers = True
        # Our thread's alone.
        self.consumers: dict[str, Consumer] = {}
        self.head = Head()
        self._swept_at = 0.0
        self._watching = False   # our watches on unowned/ and owned/ were added
        self._told_legacy = False   # names stored before 0.2 were found and said so
        self._unowned_cb = weak_callback(self._on_unowned)
        self._owned_cb = weak_callback(self._on_owned)
        self._election_cb = weak_callback(self._on_election_event)
        self.planner = Planner(session, layout, options, queue, weak_callback(self.wake))
        self.delayed = Delayed(self.queues, queue, weak_callback(self.wake))
        session.add_listener(self._election_cb)   # a new connection: look again
        session.on_close(self.stop)

    @classmethod
    def of(cls, session: SharedSession, layout: Layout, options: ZKOptions,
           queue: str) -> Dispatcher:
        """The one dispatch duty of ``queue`` under ``layout``'s root in this session."""
        return session.singleton(("dispatcher", layout.root, queue),
                                 lambda: cls(session, layout, options, queue))

    # -- membership and election ----------------------------------------------------
    def join(self, consumer_id: str, wake: Callable[[], None]) -> None:
        """A consumer of this process registered on the queue; ``wake`` wakes its
        consuming thread, which keeps the election's watch set (:meth:`watch`)."""
        with self._lock:
            self.members[consumer_id] = wake
        self._stale_election = True
        self.watch()

    def leave(self, consumer_id: str) -> None:
        with self._lock:
            self.members.pop(consumer_id, None)
        self._elect()

    def watch(self) -> None:
        """Keep the watch on the queue's consumers/ set, and elect (a member's
        consuming thread calls this on every look: a flag check, unless the
        watch fired, the connection changed, or the directory was deleted)."""
        if not self._stale_election:
            return
        self._stale_election = False
        client = self.session.client
        path = self.layout.queue_consumers(self.queue)
        try:
            children = client.retry(client.get_children, path, watch=self._election_cb)
        except NoNodeError:
            # The queue was deleted (an auto-delete queue swept while its owner was
            # away): watch for it to come back, when its consumers register again.
            if client.retry(client.exists, path, watch=self._election_cb) is not None:
                self._stale_election = True
            children = []
        except CONNECTION_ERRORS:
            self._stale_election = True   # the next look, once connected
            raise
        joined = sorted(p for p in map(parse_queue_consumer, children) if p)
        self.nodes = {cid: f"{cid}-{seq:010d}" for seq, cid in joined}
        self.live = [cid for _, cid in joined]
        self._stale_consumers = True
        self._elect()

    def _on_election_event(self, _event: Any) -> None:
        # kazoo's event thread (a fired watch, or a connection change): flag and wake.
        self._stale_election = True
        for wake in list(self.members.values()):
            wake()

    @property
    def leading(self) -> bool:
        live = self.live
        return bool(live) and live[0] in self.members and not self._stopped

    def _elect(self) -> None:
        with self._lock:
            # _thread is cleared only by the thread itself, under this lock, once it
            # has found us not leading: a thread on its way out (stopping its
            # watches) still counts, and looks again before it goes.
            if self.leading and self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"celery_zk-dispatch-{self.queue}")
                self._thread.start()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    # -- watch callbacks: kazoo's threads, record and wake -------------------------
    def _on_unowned(self, event_type: int, path: str) -> None:
        if event_type in (NODE_CREATED, NODE_DELETED) and "/" in path:
            self._arrivals.append((event_type, path))
        elif path and event_type == NODE_DELETED:
            # A bucket deleted tells nothing: only an empty one is, by a listing
            # that found it so. (Relisting for it, once per bucket in a drain,
            # listed the next bucket whole again: 4,096 names.)
            return
        else:
            # A bucket made, or unowned/ itself: list again. The listing deletes
            # the buckets emptied before it; a steady trickle, whose head never
            # runs out, lists for nothing else.
            self._stale_listing = True
        self._wake.set()

    def _on_owned(self, event_type: int, path: str) -> None:
        if event_type in (NODE_CREATED, NODE_DELETED) and path.count("/") == 1:
            self._inbox_events.append((event_type, path))
            # Only a departure frees credit. An arrival is our own gift seen
            # (counted already) or a hand-off (less to give): read at the next
            # round, not worth waking this thread for, once per message.
            if event_type == NODE_DELETED:
                self._wake.set()

    # -- the dispatcher thread ------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                logger.debug("celery_zk: dispatching queue %r", self.queue)
                self._dispatch_while_leading()
                self._stop_watches()
                with self._lock:
                    if not self.leading:
                        logger.debug("celery_zk: no longer dispatching queue %r", self.queue)
                        return
                # Leading again while we stopped (a consumer that left and joined
                # again, a queue swept and declared again): go on. Leaving here
                # instead left a queue without a dispatcher until its consumers
                # changed again, and a lone consumer (a worker's pidbox queue) for good.
        finally:
            with self._lock:
                self._thread = None   # under the lock, after the last look: see _elect

    def _dispatch_while_leading(self) -> None:
        timeout: float | None = None
        while self.leading:
            self._wake.wait(timeout)
            self._wake.clear()
            if not self.leading:
                break
            try:
                due = self._round()
                # Look by itself when a keyed message may be given, or a sweep is due.
                timeout = SWEEP_EVERY if due is None else min(due, SWEEP_EVERY)
            except CONNECTION_ERRORS as exc:
                log_failure(logger, exc, "celery_zk: dispatching %r paused: ZooKeeper is "
                            "away; going on when it answers", self.queue, level=logging.INFO)
                self._restart()
                timeout = 0.5
            except Exception as exc:
                log_failure(logger, exc, "celery_zk: a dispatch round of %r failed; "
                            "retrying in 1 s", self.queue, level=logging.ERROR)
                self._restart()
                timeout = 1.0

    def _stop_watches(self) -> None:
        """No longer the dispatcher: the watches would only pile up events."""
        if self._watching:
            self._watching = False
            watches = watches_of(self.session)
            try:
                watches.unwatch(self.layout.unowned(self.queue), self._unowned_cb)
                watches.unwatch(self.layout.owned(self.queue), self._owned_cb)
                watches.unwatch(self.layout.delayed(self.queue), self.delayed.callback)
            except CONNECTION_ERRORS:
                pass   # they went with the connection
        self._arrivals.clear()
        self._inbox_events.clear()

    def _restart(self) -> None:
        """Forget what the watches told: list everything again next round."""
        self.planner.forget()
        self.delayed.forget()
        self._stale_listing = self._stale_consumers = True
        for consumer in self.consumers.values():
            consumer.listed = False

    def _round(self) -> float | None:
        """Give what can be given; seconds until a look is due by itself (None: none)."""
        self._ensure_watches()
        self._sweep()
        # First: what it promotes is seen by the watch on unowned/ (at the next round).
        delayed_in = self.delayed.round()
        self._apply_events()
        if self._stale_consumers:
            self._read_consumers()
        self._list_inboxes()
        retry_in: float | None = None
        while True:
            hungry = [c for c in self.consumers.values() if c.free > 0]
            if not hungry:
                break
            if self._stale_listing or not (self.head.names or self.head.complete):
                if not self._list():
                    break
            elif not self.head.names:
                # The last listing saw every waiting message and the watches
                # added each one since: nothing waits. (Listing here cost two
                # requests per message in a trickle, whose head runs out at
                # every give.)
                break
            plan, retry_in = self.planner.plan(self.head, self.consumers, hungry, self.live)
            if not plan:
                break
            self._give(plan)
        if retry_in is None or delayed_in is None:
            return delayed_in if retry_in is None else retry_in
        return min(retry_in, delayed_in)

    def _ensure_watches(self) -> None:
        """Persistent watches on unowned/ and owned/, (re)added on a new connection."""
        watches = watches_of(self.session)
        unowned, owned = self.layout.unowned(self.queue), self.layout.owned(self.queue)
        delayed = self.layout.delayed(self.queue)
        if (self._watching and watches.active(unowned) and watches.active(owned)
                and watches.active(delayed)):
            return
        self._restart()
        # Added before the listings they keep current: nothing falls between.
        self._arrivals.clear()
        self._inbox_events.clear()
        watches.watch(unowned, self._unowned_cb)
        watches.watch(owned, self._owned_cb)
        watches.watch(delayed, self.delayed.callback)
        self._watching = True

    def _apply_events(self) -> None:
        head = self.head
        gone: set[str] = set()
        while self._arrivals:
            event_type, path = self._arrivals.popleft()
            name = path.rpartition("/")[2]
            if event_type == NODE_DELETED:
                gone.add(name)
                continue
            message = parse_message_name(name)
            if message is None or message.bucket != path.partition("/")[0]:
                self._stale_listing = True   # foreign: the listing dead-letters it
            else:
                gone.discard(name)
                head.add(name, message)
        if gone:
            head.discard(gone)
        while self._inbox_events:
            event_type, path = self._inbox_events.popleft()
            owner, _, name = path.partition("/")
            consumer = self.consumers.get(owner)
            if consumer is None or not consumer.listed:
                continue
            if event_type == NODE_CREATED:
                consumer.entries.add(name)
                consumer.given.discard(name)
            else:
                consumer.entries.discard(name)

    def _read_consumers(self) -> None:
        """Read each live consumer's credit and worker (pipelined)."""
        self._stale_consumers = False
        client = self.session.client
        live, nodes = list(self.live), dict(self.nodes)
        reads = [(cid, client.get_async(self.layout.queue_consumer(self.queue, nodes[cid]),
                                        watch=self._child_cb_for_consumers))
                 for cid in live]
        found: dict[str, Consumer] = {}
        for cid, (data, _) in answered(reads):
            consumer = self.consumers.get(cid) or Consumer(cid, nodes[cid])
            consumer.node = nodes[cid]
            meta = json_object(data)
            credit = meta.get("credit")
            # No prefetch limit: what it takes out of its inbox at a time.
            consumer.credit = (self.options.claim_batch
                               if not isinstance(credit, int) or credit <= 0 else credit)
            worker = meta.get("worker")
            consumer.worker = worker if isinstance(worker, str) else None
            found[cid] = consumer
        self.consumers = found

    def _child_cb_for_consumers(self, event: Any) -> None:
        self._stale_consumers = True   # a credit changed (a data watch)
        self._wake.set()

    def _list_inboxes(self) -> None:
        """List the inboxes we do not know yet (the watch keeps them current)."""
        client = self.session.client
        reads = [(c, client.get_children_async(self.layout.inbox(self.queue, c.id)))
                 for c in self.consumers.values() if not c.listed]
        for consumer, read in reads:
            try:
                names = set(read.get())
            except NoNodeError:
                names = set()   # not made yet (it makes it before registering), or gone
            # Sent after our last multi came back: it shows everything we gave.
            consumer.entries = names
            consumer.given.clear()
            consumer.listed = True

    def _list(self) -> bool:
        """List the head of the queue; False when nothing waits."""
        self._stale_listing = False
        want = max(self.options.claim_batch,
                   2 * sum(max(0, c.free) for c in self.consumers.values()))
        found = self.queues.listing(self.queue, want)
        for name in found.foreign:
            if not is_legacy(name.rpartition("/")[2]):
                self.acks.dead_letter_waiting(self.queue, name,
                                              "node name was not written by celery_zk")
            elif not self._told_legacy:   # left for `celery zk upgrade`, said once
                self._told_legacy = True
                logger.error("celery_zk: queue %r holds messages stored by celery_zk "
                             "before 0.2, which this release does not deliver; run "
                             "`celery -A proj zk upgrade` once to store them as every "
                             "other message is", self.queue)
        self.head.reset(found.names, found.complete)
        return bool(self.head.names)

    def _sweep(self) -> None:
        """Now and then: bodies' buckets left empty, chunks no message points at."""
        now = monotonic()
        if now - self._swept_at < SWEEP_EVERY:
            return
        self._swept_at = now
        buckets, _ = self.queues.buckets(self.queue)
        self.queues.sweep_bodies(self.queue, buckets)
        big.sweep(self.session.client, self.layout, self.queue)

    def _give(self, plan: dict[str, list[str]]) -> None:
        """One multi; on a refusal, forget what refused it (the next pass plans again)."""
        client = self.session.client
        nodes = {cid: self.consumers[cid].node for cid in plan}
        txn, done = assignment(client, self.layout, self.queue, plan, nodes)
        records = self.planner.records()
        for limit, times in records:
            # In the multi that gives them: a dispatcher taking over sees them.
            txn.set_data(self.layout.limit_given(limit.kind, limit.name),
                         json.dumps(times).encode())
            done.ops.append(("limit", limit.kind, limit.name))
        try:
            results = txn.commit()
        except ConnectionLoss:
            # Whether it committed is unknown: look at everything again.
            self._restart()
            raise
        refused = settle(done, results)
        if refused is None:
            self.planner.given(records)
            given = done.given()
            for cid, names in given.items():
                self.consumers[cid].given.update(names)
            self.head.discard(name for names in given.values() for name in names)
            return
        kind, cid, name = refused
        if kind == "limit":   # its record of give times is missing: made, and again
            self.planner.make_given_record(cid, name)
            return
        if kind == "check":   # gone, or stopped consuming the queue
            self.consumers.pop(cid, None)
            self._stale_consumers = True
        elif kind == "delete":   # taken by basic_get, purged, or moved by another dispatcher
            self.head.discard({name})
        else:   # its inbox is gone (a consumer leaving) or has it already
            consumer = self.consumers.get(cid)
            if consumer is not None:
                consumer.listed = False
                self._list_inboxes()
            if client.retry(client.exists, self.layout.unowned_message(self.queue, name)) is None:
                self.head.discard({name})


