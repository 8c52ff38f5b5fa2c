"""A queue's stored limits applied: ``x-max-length`` to publishes, and the
count of messages a queue dropped undelivered (over its length, or expired).

RabbitMQ counts a queue's length in messages ready for delivery: here the
names waiting in its buckets, counted from the buckets' stats (no listing).
A process reads it at most every :data:`CHECK_EVERY` seconds per queue and
adds its own publishes meanwhile, so a publish costs no read; it reads again
before it refuses a publish (``reject-publish``) or drops the head
(``drop-head``), so neither acts on a stale count. Publishers of other
processes may overshoot ``reject-publish`` by what they send within one
check; ``drop-head`` always trims back to the limit.

What a queue drops without delivering is counted in ``queues/{q}/dropped``
(``{"expired": n, "dropped": n}``), added without waiting for the reply: for
``celery zk status`` and the exporter.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, KazooException, NodeExistsError, NoNodeError

from ..exceptions import QueueFull
from .acks import Acks
from .budget import CHECK_EVERY
from .queue_arguments import DROP_HEAD, REJECT_PUBLISH, Limits, expired
from .queues import Queues
from .ready import Claimed

__all__ = ["QueueLimits", "count_dropped"]

logger = logging.getLogger(__name__)

#: Queues whose limits a process remembers: reply queues take a new name
#: each, so what is forgotten is read again.
KNOWN_QUEUES = 1024


class QueueLimits:
    """One connection's view of the limits of the queues it uses."""

    def __init__(self, queues: Queues, acks: Acks) -> None:
        self.queues = queues
        self.acks = acks
        self.dead_letter = queues.options.dead_letter_rejected
        self._expired: dict[str, int] = {}   # queue -> expired, not counted yet
        self._limits: dict[str, Limits] = {}
        self._length: dict[str, tuple[int, float]] = {}   # queue -> (count, read at)
        self._lock = threading.Lock()

    def of(self, queue: str, fresh: bool = False) -> Limits:
        """The queue's stored limits (read once per process, or ``fresh``)."""
        limits = self._limits.get(queue)
        if limits is None or fresh:
            client = self.queues.client
            try:
                data = client.retry(client.get, self.queues.layout.queue(queue))[0]
            except NoNodeError:
                return Limits()   # not declared (yet): nothing to remember
            limits = Limits.stored(data)
            self.learn(queue, limits)
        return limits

    def learn(self, queue: str, limits: Limits) -> None:
        """What a queue was stored with (a declaration that created it knows)."""
        if len(self._limits) >= KNOWN_QUEUES:   # reply queues: a new name each
            self._limits.clear()
        self._limits[queue] = limits

    # -- x-max-length -------------------------------------------------------------
    def before_publish(self, queue: str) -> None:
        """``reject-publish``: refuse a publish to a full queue (QueueFull)."""
        limits = self.of(queue)
        if limits.max_length is None or limits.overflow != REJECT_PUBLISH:
            return
        full = limits.max_length
        if self._count(queue) >= full and self._read_length(queue) >= full:   # read again
            raise QueueFull(
                f"Queue {queue!r} is full: {self._length[queue][0]:,} messages wait, its "
                f"x-max-length is {limits.max_length:,} with x-overflow reject-publish. "
                "Nothing was written. Retry once consumers have taken some, or declare the "
                "queue with a larger max_length (delete it first: a declaration does not "
                "change a queue's arguments).")

    def after_publish(self, queue: str) -> None:
        """Count the publish; ``drop-head``: trim the queue back to its length."""
        limits = self.of(queue)
        if limits.max_length is None:
            return
        with self._lock:
            count, read_at = self._length.get(queue, (0, 0.0))
            self._length[queue] = (count + 1, read_at)
        if limits.overflow == DROP_HEAD and self._count(queue) > limits.max_length:
            over = self._read_length(queue) - limits.max_length
            if over > 0:
                self._drop_head(queue, over)

    def _count(self, queue: str) -> int:
        count, read_at = self._length.get(queue, (0, 0.0))
        return count if time.monotonic() - read_at < CHECK_EVERY else self._read_length(queue)

    def _read_length(self, queue: str) -> int:
        count = self.queues.size(queue)
        with self._lock:
            self._length[queue] = (count, time.monotonic())
        return count

    def _drop_head(self, queue: str, over: int) -> None:
        names = self.queues.listing(queue, over).names[:over]
        if self.dead_letter:
            reason = "dropped: the queue was over its x-max-length (x-overflow drop-head)"
            dropped = sum(self.acks.dead_letter_waiting(queue, name, reason) for name in names)
        else:
            dropped = self.queues.delete_waiting(queue, names)
        with self._lock:
            count, read_at = self._length[queue]
            self._length[queue] = (count - dropped, read_at)
        count_dropped(self.queues.client, self.queues.layout.queue_dropped(queue),
                      "dropped", dropped)

    # -- message lifetimes ----------------------------------------------------------
    def expired(self, claimed: Claimed, properties: dict[str, Any]) -> bool:
        """Whether a message given to this consumer has expired (its queue's
        x-message-ttl, its own expiration): then it is never delivered, but
        dead-lettered (option dead_letter_rejected) or deleted, and counted."""
        why = expired(properties, claimed.stored_at, self.of(claimed.queue).message_ttl,
                      time.time())
        if why is None:
            return False
        owned_path, queue = claimed.owned_path, claimed.queue
        if self.dead_letter:
            self.acks.remove(owned_path, dead_letter=True, reason=f"expired: {why}",
                             expected=True)
        else:
            self.acks.discard(owned_path)   # a backlog of expired ones goes at full speed
        with self._lock:
            first = not self._expired
            self._expired[queue] = self._expired.get(queue, 0) + 1
        if first:   # counted together, once the deferred writes go
            self.queues.deferred.later(self._count_expired)
        return True

    def _count_expired(self) -> None:
        with self._lock:
            expired, self._expired = self._expired, {}
        for queue, count in expired.items():
            count_dropped(self.queues.client, self.queues.layout.queue_dropped(queue),
                          "expired", count)


def count_dropped(client: KazooClient, path: str, kind: str, count: int) -> None:
    """Add ``count`` to ``kind`` in a queue's ``dropped`` node, without waiting:
    each step only sends the next request (safe on kazoo's thread)."""
    if count <= 0:
        return

    def again(result: Any) -> None:
        try:
            result.get()
        except (BadVersionError, NodeExistsError):
            count_dropped(client, path, kind, count)   # another process counted meanwhile
        except KazooException as exc:   # a queue deleted meanwhile, or a blip: a count lost
            logger.debug("celery_zk: %s of %s not counted: %r", kind, path, exc)

    def read(result: Any) -> None:
        try:
            data, stat = result.get()
        except NoNodeError:
            try:
                client.create_async(path, json.dumps({kind: count}).encode()).rawlink(again)
            except KazooException as exc:
                logger.debug("celery_zk: %s of %s not counted: %r", kind, path, exc)
            return
        except KazooException as exc:
            logger.debug("celery_zk: %s of %s not counted: %r", kind, path, exc)
            return
        counts = dropped_counts(data)
        counts[kind] = counts.get(kind, 0) + count
        client.set_async(path, json.dumps(counts).encode(), stat.version).rawlink(again)

    client.get_async(path).rawlink(read)


def dropped_counts(data: bytes) -> dict[str, int]:
    try:
        counts = json.loads(data or b"{}")
    except ValueError:
        return {}
    return {k: v for k, v in counts.items() if isinstance(v, int)} if isinstance(
        counts, dict) else {}
