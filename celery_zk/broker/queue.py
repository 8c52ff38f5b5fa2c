"""The queue protocol: put, claim, ack, requeue, dead-letter, purge, as one
store (:class:`QueueStore`) made of :mod:`.publish`, :mod:`.claims` and
:mod:`.acks` over :mod:`.store`; here: listing a queue, its size, purge
and delete.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

from kazoo.exceptions import (
    NoNodeError,
    NotEmptyError,
)

from ..zk.client import (
    log_failure,
    multi_failure,
    reply_or_retry,
)
from ..zk.names import (
    MessageName,
    parse_bucket_name,
    parse_message_name,
    same_priority,
    sort_messages,
    unescape,
)
from ..zk.payload import commit_deleting
from ..zk.tree import delete_tree
from . import big
from .acks import ACK_BATCH, Acking
from .claims import CLAIMS, Assignment, ClaimCounts, Claimed, Claiming
from .publish import PUBLISH_BATCH, NewMessage, Publishing, new_uid
from .store import ANY_VERSION, OP_OVERHEAD, ClientSource, StoreBase, _in_place, creates

__all__ = ["ACK_BATCH", "ANY_VERSION", "CLAIMS", "OP_OVERHEAD", "PUBLISH_BATCH", "ClaimCounts",
           "Assignment", "Claimed", "ClientSource", "Listing", "NewMessage", "QueueStore",
           "StoreBase", "creates", "new_uid"]

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Listing:
    """The head of a queue in delivery order, as :meth:`QueueStore.listing` found it."""

    names: list[str]     # ours, in delivery order
    foreign: list[str]   # names celery_zk did not write (to dead-letter)
    complete: bool = True   # every bucket was listed (else only the first ``want`` or so)

class QueueStore(Publishing, Claiming, Acking):
    """Queue operations for one kazoo client under one root."""

    def size(self, queue: str) -> int:
        """Messages waiting, from the directories' stats alone (no message listing)."""
        client = self.client
        try:
            buckets, _ = self.buckets(queue)
        except NoNodeError:
            return 0
        stats = [client.exists_async(self.layout.bucket(queue, bucket)) for bucket in buckets]
        return sum(stat.numChildren for stat in (
            reply_or_retry(client, result, client.exists, self.layout.bucket(queue, bucket))
            for bucket, result in zip(buckets, stats)) if stat is not None)

    # -- consuming ----------------------------------------------------------------
    def listing(self, queue: str, want: int) -> Listing:
        """The first ``want`` (or a few more) waiting messages of a queue, in
        delivery order, from names alone.

        Lists ``unowned/`` and then its buckets in order until ``want`` names
        are found. An empty bucket with a later one of its priority is
        deleted: no publisher will come back to it.
        """
        client = self.client
        try:
            buckets, other = self.buckets(queue)
        except NoNodeError:
            return Listing([], [])
        names: list[str] = []
        foreign = list(other)
        complete = True
        for index, bucket in enumerate(buckets):
            if len(names) >= want:
                complete = False
                break
            try:
                children = client.retry(client.get_children, self.layout.bucket(queue, bucket))
            except NoNodeError:
                continue   # emptied and deleted meanwhile
            if not children:
                if index + 1 < len(buckets) and same_priority(bucket, buckets[index + 1]):
                    self._delete_bucket(queue, bucket)   # nobody publishes to it again
                continue
            ours, theirs = _in_place(bucket, children)
            names += ours
            foreign += theirs
        return Listing(sort_messages(names)[0], foreign, complete)

    def _delete_bucket(self, queue: str, bucket: str) -> None:
        """Delete an empty bucket, and its bodies' twin if that is empty too, in
        the background (each refused if something came meanwhile; a twin that
        still holds bodies of owned messages is left to :meth:`sweep_bodies`)."""
        def done(result: Any) -> None:   # kazoo's thread: never block
            try:
                result.get()
            except (NoNodeError, NotEmptyError):
                pass
            except Exception as exc:
                log_failure(logger, exc, "celery_zk: could not delete the empty bucket "
                            "%s of queue %r; the next listing tries again", bucket, queue)
        client = self.client
        client.delete_async(self.layout.bucket(queue, bucket)).rawlink(done)
        client.delete_async(self.layout.body_bucket(queue, bucket)).rawlink(done)

    def sweep_bodies(self, queue: str, buckets: list[str]) -> None:
        """Delete the bodies' buckets whose bucket is gone (``buckets``: those of
        ``unowned/`` now) once their last body was acked; refused while not empty."""
        client = self.client
        try:
            twins = client.retry(client.get_children, self.layout.bodies(queue))
        except NoNodeError:
            return
        present = set(buckets)
        for twin in twins:
            if twin not in present and parse_bucket_name(twin) is not None:
                self._delete_bucket(queue, twin)

    # -- maintenance --------------------------------------------------------------
    def purge(self, queue: str) -> int:
        """Delete every waiting (unowned) message; owned ones are being worked on.
        One bucket at a time, so a huge backlog is never listed at once, and a
        few hundred messages (names and bodies) per multi."""
        client, layout = self.client, self.layout
        try:
            buckets, _ = self.buckets(queue)
        except NoNodeError:
            return 0
        removed = 0
        for bucket in buckets:
            try:
                names = client.retry(client.get_children, layout.bucket(queue, bucket))
            except NoNodeError:
                continue
            removed += self._delete_waiting(queue, names)
        return removed

    def _delete_waiting(self, queue: str, names: list[str]) -> int:
        """Delete waiting messages (each name with its body), :data:`ACK_BATCH`
        per multi; how many this call deleted."""
        layout = self.layout

        def deletes(batch: list[str]) -> Callable[[Any], None]:
            def build(txn: Any) -> None:
                for name in batch:
                    txn.delete(layout.unowned_message(queue, name))
                    message = parse_message_name(name)
                    body = layout.body(queue, message) if message is not None else None
                    if body is not None:
                        txn.delete(body)
            return build

        removed = 0
        small = []
        for name in names:
            message = parse_message_name(name)
            if message is not None and message.chunked:
                removed += self._delete_big_waiting(queue, name, message)
            else:
                small.append(name)
        names = small
        for start in range(0, len(names), ACK_BATCH):
            batch = names[start:start + ACK_BATCH]
            if multi_failure(self.commit(deletes(batch))) is None:
                removed += len(batch)
                continue
            # One was given to a consumer meanwhile (or purged by someone else),
            # which refused the multi: the rest one by one.
            removed += sum(1 for name in batch
                           if multi_failure(self.commit(deletes([name]))) is None)
        return removed

    def _delete_big_waiting(self, queue: str, name: str, message: MessageName) -> int:
        """Delete a waiting big message: name, body and chunks (see celery_zk.broker.big)."""
        layout, client = self.layout, self.client
        body = layout.body(queue, message)

        def build(txn: Any) -> None:
            txn.delete(layout.unowned_message(queue, name))
            txn.delete(body)

        failure = commit_deleting(client, build, big.delete_paths(client, layout, queue, message))
        return 1 if failure is None else 0

    def delete_all(self, paths: list[str]) -> int:
        """Pipelined deletes; how many this call deleted."""
        client = self.client
        removed = 0
        for result in [client.delete_async(path) for path in paths]:
            try:
                result.get()
                removed += 1
            except NoNodeError:
                pass  # requeued or purged by someone else meanwhile
        return removed

    def delete(self, queue: str) -> None:
        """Remove a queue and everything in it (messages included): in one
        transaction unless it holds more than :data:`~celery_zk.zk.tree.DELETE_BATCH`
        nodes (a backlog's messages then go in batches first)."""
        delete_tree(self.client, self.layout.queue(queue))

    def owned_listing(self, queue: str) -> list[str]:
        client = self.client
        try:
            return client.retry(client.get_children, self.layout.owned(queue))
        except NoNodeError:
            return []

    def queue_names(self) -> Iterable[str]:
        client = self.client
        try:
            return [unescape(n) for n in client.retry(client.get_children, self.layout.queues)]
        except NoNodeError:
            return []
