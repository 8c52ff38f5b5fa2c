"""Delayed messages: a task whose eta is more than :data:`DELAY_FROM` ahead
waits under its queue's ``delayed/`` until it is due, not in a worker's memory.

It waits under the name it will have in line, its uid begun by its due
time, so the dispatcher (:mod:`celery_zk.broker.dispatcher`) knows what is
due from listings alone; promotion moves only the name, in one multi with
the delete. See ``docs/design.md``, "Message lifecycle" (*Delayed delivery*),
and ``docs/features.md``, "Delayed delivery: ETA tasks wait in ZooKeeper".
"""
from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from ..zk.client import answered, children, multi_failure
from ..zk.layout import Layout
from ..zk.message_names import (
    DELAYED_BUCKET_MS,
    DELAYED_DAY_MS,
    MessageName,
    due_of,
    parse_delayed_bucket,
    parse_delayed_day,
    parse_message_name,
    promoted_name,
)
from ..zk.session import weak_callback
from ..zk.watches import NODE_CREATED
from .queues import Queues

__all__ = ["DELAY_FROM", "Delayed", "due", "stats"]

logger = logging.getLogger(__name__)

#: Seconds: a message due sooner than this is delivered at once (its worker
#: waits, as Celery's do on any broker); later, it waits in delayed/.
DELAY_FROM = 1.0
#: Most messages promoted in one multi (two or three operations each).
PROMOTE_BATCH = 128
_NEVER = float("inf")


def due(message: dict[str, Any]) -> int | None:
    """When a kombu message asks to be delivered (ms since the epoch): its task's
    ``eta`` header (Celery's protocol 2, ``countdown`` included), if at least
    :data:`DELAY_FROM` ahead; else None. An eta without a timezone is in the
    app's, which the broker does not know: such a task is delivered at once."""
    eta = (message.get("headers") or {}).get("eta")
    if not isinstance(eta, str):
        return None
    try:
        when = datetime.fromisoformat(eta)
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    due_ms = int(when.timestamp() * 1000)
    return due_ms if due_ms > (time.time() + DELAY_FROM) * 1000 else None


def _now() -> int:
    return int(time.time() * 1000)


class Delayed:
    """A queue's delayed messages, for its dispatcher's thread (see module docstring)."""

    def __init__(self, queues: Queues, queue: str, wake: Callable[[], None]) -> None:
        self.queues = queues
        self.layout = queues.layout
        self.queue = queue
        self.wake = wake
        #: For the persistent recursive watch on delayed/ (kazoo's thread).
        self.callback = weak_callback(self._on_event)
        self._arrived: deque[tuple[str, str]] = deque()   # (day/bucket, name): kazoo's thread
        self.forget()

    def forget(self) -> None:
        """Know nothing: look at delayed/ again (a new connection, a new dispatcher)."""
        self._heap: list[tuple[int, str, str]] = []   # (due, day/bucket, name)
        self._known: set[str] = set()                 # the names in the heap
        self._pending: dict[str, int] = {}            # day/bucket -> its names in the heap
        # unowned/'s buckets as last listed (None: list them), kept while promotions
        # succeed: a stale one fails a multi, which lists them again.
        self._buckets: set[str] | None = None
        self._opened: dict[str, int] = {}   # day/bucket listed (or seen made) -> its start
        self._open_until = -1   # buckets starting before it: listed, later names by events
        self._look_at = 0.0     # when to list delayed/ again (ms)
        self._look_again = True   # set by the watch: something is due sooner than _look_at
        self._arrived.clear()

    # -- the watch: kazoo's thread, record and wake --------------------------------
    def _on_event(self, event_type: int, path: str) -> None:
        if event_type != NODE_CREATED:
            return
        parts = path.split("/")
        bucket = parse_delayed_bucket(parts[1]) if len(parts) > 1 else None
        if bucket is None:
            return   # delayed/ or a day made: its first bucket comes next
        if bucket[0] < self._open_until:
            if len(parts) == 3:
                self._arrived.append((f"{parts[0]}/{parts[1]}", parts[2]))
                self.wake()
        elif bucket[0] < self._look_at:   # due before all we know of: look now
            self._look_again = True
            self.wake()

    # -- the dispatcher's thread ------------------------------------------------------
    def round(self) -> float | None:
        """Promote what is due; seconds until more is (None: nothing is delayed)."""
        while self._arrived:
            self._add(*self._arrived.popleft())
        now = _now()
        if self._look_again or now >= self._look_at:
            self._look_again = False   # before the look: an event during it looks again
            self._look(now)
        if self._heap and self._heap[0][0] <= now:
            self._promote(now)
        if self._opened:
            self._close(now)
        nearest = min(self._heap[0][0] if self._heap else _NEVER, self._look_at)
        return None if nearest == _NEVER else max(0.0, (nearest - _now()) / 1000)

    def _add(self, bucket: str, name: str) -> None:
        message = parse_message_name(name)
        start = parse_delayed_bucket(bucket.partition("/")[2])
        when = None if message is None else due_of(message)
        if name in self._known or when is None or start is None:
            return   # a listing and an event both told; or not ours, left alone
        self._known.add(name)
        self._pending[bucket] = self._pending.get(bucket, 0) + 1
        self._opened.setdefault(bucket, start[0])
        heapq.heappush(self._heap, (when, bucket, name))

    def _look(self, now: int) -> None:
        """List the buckets of minutes begun and not listed yet, and find when the next begins."""
        client, delayed = self.queues.client, self.layout.delayed(self.queue)
        # Before the listings: a name made in a bucket that begins before this
        # comes from here on by its event, and before it in the listings.
        self._open_until = max(self._open_until, (now // DELAYED_BUCKET_MS + 1) * DELAYED_BUCKET_MS)
        self._look_at = _NEVER
        try:
            days = client.retry(client.get_children, delayed)
        except NoNodeError:
            return
        listed: list[tuple[str, Any]] = []
        for day, start in sorted(_parsed(days, parse_delayed_day)):
            if start >= self._open_until:
                self._look_at = min(self._look_at, start)
                break
            try:
                buckets = client.retry(client.get_children, self.layout.delayed(self.queue, day))
            except NoNodeError:
                continue
            if not buckets and start + DELAYED_DAY_MS < now:   # gone by, all promoted
                self.queues.delete_if_empty(self.layout.delayed(self.queue, day))
            for bucket, begins in sorted(_parsed(buckets, _start)):
                if begins >= self._open_until:
                    self._look_at = min(self._look_at, begins)
                    break
                if f"{day}/{bucket}" not in self._opened:
                    path = self.layout.delayed(self.queue, day, bucket)
                    listed.append((f"{day}/{bucket}", client.get_children_async(path)))
            if self._look_at < _NEVER:
                break   # later days begin later still
        for bucket, names in answered(listed):
            self._opened.setdefault(bucket, _start(bucket.partition("/")[2]))
            for name in names:
                self._add(bucket, name)

    def _promote(self, now: int) -> None:
        """Move every due message to wait in unowned/, :data:`PROMOTE_BATCH` per multi."""
        if self._buckets is None:
            self._buckets = set(self.queues.buckets(self.queue)[0])
        buckets = self._buckets
        while self._heap and self._heap[0][0] <= now:
            batch = [heapq.heappop(self._heap)
                     for _ in range(min(PROMOTE_BATCH, len(self._heap)))
                     if self._heap[0][0] <= now]
            if self._move(batch, buckets) is not None:
                # One was revoked, purged or moved by another dispatcher, or a
                # bucket came or went: each alone, the buckets looked at again after.
                for _, bucket, name in batch:
                    self.queues.move(*self._promotion(bucket, name)[1:])
                buckets = self._buckets = set(self.queues.buckets(self.queue)[0])
            for _, bucket, name in batch:
                self._known.discard(name)
                self._pending[bucket] -= 1
                if not self._pending[bucket]:
                    del self._pending[bucket]

    def _move(self, batch: list[tuple[int, str, str]],
              buckets: set[str]) -> tuple[int, Exception] | None:
        txn = self.queues.client.transaction()
        made: list[str] = []
        for _, bucket, name in batch:
            message, source, target = self._promotion(bucket, name)
            if message.bucket not in buckets:   # emptied and deleted: made again, up front
                txn.create(self.layout.bucket(self.queue, message.bucket))
                buckets.add(message.bucket)
                made.append(message.bucket)
            txn.create(target)
            txn.delete(source)
        failure = multi_failure(txn.commit())
        if failure is not None:
            buckets.difference_update(made)
        return failure

    def _promotion(self, bucket: str, name: str) -> tuple[MessageName, str, str]:
        """A delayed message, where it waits, and where it goes when due."""
        message = parse_message_name(name)
        assert message is not None   # _add parsed it
        return (message, self.layout.delayed(self.queue, bucket, name),
                self.layout.unowned_message(self.queue, promoted_name(message)))

    def _close(self, now: int) -> None:
        """Delete the buckets of minutes gone by whose every message was promoted."""
        for bucket, start in list(self._opened.items()):
            if start + DELAYED_BUCKET_MS < now and bucket not in self._pending:
                del self._opened[bucket]
                self.queues.delete_if_empty(self.layout.delayed(self.queue, bucket))
                # Then its day, once gone by and empty (the look deletes it).
                self._look_at = min(self._look_at, now + 1000)


def stats(client: KazooClient, layout: Layout, queue: str) -> tuple[int, int | None]:
    """``(how many delayed messages, when the next is due or None)``: a
    listing per day and a stat per bucket, the earliest bucket listed."""
    delayed = layout.delayed(queue)
    try:
        days = sorted(_parsed(client.retry(client.get_children, delayed), parse_delayed_day))
    except NoNodeError:
        return 0, None
    buckets: list[tuple[int, str]] = []
    for day, listing in [(day, client.get_children_async(layout.delayed(queue, day)))
                         for day, _ in days]:   # one pipelined round
        try:
            names = listing.get()
        except NoNodeError:
            continue
        buckets += [(start, layout.delayed(queue, day, bucket)) for bucket, start in
                    _parsed(names, _start)]
    replies = [client.exists_async(path) for _, path in buckets]
    count = sum(stat.numChildren for stat in (r.get() for r in replies) if stat is not None)
    nearest: int | None = None
    for start, path in sorted(buckets):
        if nearest is not None and start >= nearest:
            break
        dues = [when for when in (due_of(m) for m in map(parse_message_name, children(client, path))
                                  if m is not None) if when is not None]
        if dues:
            nearest = min(dues) if nearest is None else min(nearest, *dues)
    return count, nearest


def _start(bucket: str) -> int:
    parsed = parse_delayed_bucket(bucket)
    return -1 if parsed is None else parsed[0]


def _parsed(names: list[str], parse: Callable[[str], int | None]) -> list[tuple[str, int]]:
    """``(name, start)`` of each name ``parse`` knows (its start ≥ 0)."""
    return [(name, start) for name, start in ((n, parse(n)) for n in names)
            if start is not None and start >= 0]
