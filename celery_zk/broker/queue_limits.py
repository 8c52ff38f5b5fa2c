"""A queue's stored limits applied: ``x-max-length`` and
``x-max-length-bytes`` to publishes, and the count of messages a queue
dropped undelivered (over a limit, or expired) in ``queues/{q}/dropped``.

A process reads a queue's length (its buckets' stats) and bytes (the sizes
its names carry) at most every :data:`CHECK_EVERY` seconds, adding its own
publishes meanwhile, so a publish costs no read; it must read again before
it refuses a publish (``reject-publish``) or drops the head (``drop-head``),
so neither acts on a stale count. See ``docs/configuration.md``, "Queue
arguments".
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
from ..zk.client import answered, json_object
from ..zk.message_names import parse_message_name
from .acks import Acks
from .budget import CHECK_EVERY
from .queue_arguments import DROP_HEAD, REJECT_PUBLISH, Limits, expired, warn_kept
from .queue_expiry import touch
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
        # queue -> (messages, bytes, read at): bytes only with x-max-length-bytes
        self._length: dict[str, tuple[int, int, float]] = {}
        # queue -> bucket -> (cversion, messages, bytes) when last listed
        self._buckets: dict[str, dict[str, tuple[int, int, int]]] = {}
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

    def declared_again(self, queue: str, declared: Limits) -> None:
        """A declaration of a queue that exists: its stored limits stay (a
        warning if they differ), and it counts as used (x-expires)."""
        kept = self.of(queue, fresh=True)
        warn_kept(queue, declared, kept)
        if kept.expires is not None:
            touch(self.queues, queue)

    def counts_bytes(self, queue: str) -> bool:
        """Whether the queue's message names carry their size (x-max-length-bytes)."""
        return self.of(queue).max_length_bytes is not None

    # -- x-max-length, x-max-length-bytes --------------------------------------------
    def before_publish(self, queue: str, size: int) -> None:
        """``reject-publish``: refuse a publish (of ``size`` bytes) to a full queue
        (QueueFull)."""
        limits = self.of(queue)
        if limits.overflow != REJECT_PUBLISH or not _limited(limits):
            return
        if _full(limits, self._count(queue), size) and _full(
                limits, self._read_waiting(queue), size):   # read again before refusing
            count, size_now = self._length[queue][:2]
            what = (f"its x-max-length is {limits.max_length:,}"
                    if limits.max_length is not None and count >= limits.max_length else
                    f"they hold {size_now:,} bytes and this one {size:,}, its "
                    f"x-max-length-bytes is {limits.max_length_bytes:,}")
            raise QueueFull(
                f"Queue {queue!r} is full: {count:,} messages wait, {what} with x-overflow "
                "reject-publish. Nothing was written. Retry once consumers have taken "
                "some, or declare the queue with larger limits (delete it first: a "
                "declaration does not change a queue's arguments).")

    def after_publish(self, queue: str, size: int) -> None:
        """Count the publish; ``drop-head``: trim the queue back to its limits."""
        limits = self.of(queue)
        if not _limited(limits):
            return
        with self._lock:
            count, size_now, read_at = self._length.get(queue, (0, 0, 0.0))
            self._length[queue] = (count + 1, size_now + size, read_at)
        if limits.overflow == DROP_HEAD and _full(limits, self._count(queue)) and _full(
                limits, self._read_waiting(queue)):
            self._drop_head(queue, limits)

    def _count(self, queue: str) -> tuple[int, int]:
        count, size, read_at = self._length.get(queue, (0, 0, 0.0))
        if time.monotonic() - read_at < CHECK_EVERY:
            return count, size
        return self._read_waiting(queue)

    def _read_waiting(self, queue: str) -> tuple[int, int]:
        """(messages, bytes) waiting: bytes only where names carry them."""
        if self.of(queue).max_length_bytes is None:
            count, size = self.queues.size(queue), 0
        else:
            count, size = self._read_bytes(queue)
        with self._lock:
            self._length[queue] = (count, size, time.monotonic())
        return count, size

    def _read_bytes(self, queue: str) -> tuple[int, int]:
        """(messages, bytes) of a queue whose names carry their size: each
        bucket's stats, and a listing of only those whose children changed
        since this process last listed them (``cversion``): a backlog's full
        buckets are listed once, the one publishers fill at each check."""
        client, layout = self.queues.client, self.queues.layout
        known, counted = self._buckets.get(queue, {}), {}
        listings = []
        for bucket, stat in self.queues.bucket_stats(queue):
            if known.get(bucket, (None,))[0] == stat.cversion:
                counted[bucket] = known[bucket]
            else:
                listings.append(((bucket, stat.cversion),
                                 client.get_children_async(layout.bucket(queue, bucket))))
        for (bucket, cversion), names in answered(listings):   # emptied and deleted: left out
            counted[bucket] = (cversion, len(names), sum(map(named_size, names)))
        self._buckets[queue] = counted
        return (sum(count for _, count, _ in counted.values()),
                sum(size for _, _, size in counted.values()))

    def _drop_head(self, queue: str, limits: Limits) -> None:
        count, size, read_at = self._length[queue]
        # The head: what a length is over by; for bytes, its first bucket(s).
        names = self.queues.listing(queue, self.queues.options.bucket_size
                                    if limits.max_length_bytes is not None
                                    else count - (limits.max_length or 0)).names
        head = []
        for name in names:   # from the head, until both limits hold
            if not _full(limits, (count, size)):
                break
            head.append(name)
            count, size = count - 1, size - named_size(name)
        if self.dead_letter:
            limit = "x-max-length" if limits.max_length_bytes is None else (
                "x-max-length-bytes" if limits.max_length is None
                else "x-max-length or x-max-length-bytes")
            reason = f"dropped: the queue was over its {limit} (x-overflow drop-head)"
            dropped = sum(self.acks.dead_letter_waiting(queue, name, reason) for name in head)
        else:
            dropped = self.queues.delete_waiting(queue, head)
        with self._lock:   # what was not dropped was given to a consumer meanwhile
            self._length[queue] = (count, size, read_at)
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


def _limited(limits: Limits) -> bool:
    return limits.max_length is not None or limits.max_length_bytes is not None


def _full(limits: Limits, waiting: tuple[int, int], adding: int | None = None) -> bool:
    """Whether ``waiting`` (messages, bytes) is over the limits; with ``adding``
    (a publish's bytes): whether the queue is full for it."""
    count, size = waiting
    if adding is None:
        return ((limits.max_length is not None and count > limits.max_length)
                or (limits.max_length_bytes is not None and size > limits.max_length_bytes))
    return ((limits.max_length is not None and count >= limits.max_length)
            or (limits.max_length_bytes is not None
                and size + adding > limits.max_length_bytes))


def named_size(name: str) -> int:
    """The body's bytes a waiting message's name carries (0: none named)."""
    message = parse_message_name(name)
    return 0 if message is None or message.size is None else message.size


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
    return {k: v for k, v in json_object(data).items() if isinstance(v, int)}
