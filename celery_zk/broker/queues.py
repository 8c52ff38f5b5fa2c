"""A root's queues: their directories, and what is done to a queue as a whole.

Every state change that touches more than one node is one ``multi``
transaction, so a message is always in exactly one place (unowned, owned or
dead) whatever crashes in between. Operations are retried after
ConnectionLoss; because a lost reply does not say whether a transaction
committed, each retry first checks for the effect it was about to cause.
What happens to one message is elsewhere: :mod:`.publish` (put),
:mod:`.dispatcher` (give), :mod:`.acks` (ack, requeue, reject).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import ConnectionLoss, NodeExistsError, NoNodeError, NotEmptyError
from kazoo.protocol.states import ZnodeStat

from ..zk.background import Deferred
from ..zk.client import children, multi_failure, reply_or_retry, synced, unwaited
from ..zk.config import ZKOptions
from ..zk.layout import Layout
from ..zk.message_names import (
    MessageName,
    parse_bucket_name,
    parse_message_name,
    same_priority,
    sort_messages,
)
from ..zk.names import unescape
from ..zk.payload import commit_deleting, container_paths
from ..zk.tree import delete_tree

logger = logging.getLogger(__name__)

#: Most deletes in one multi of a purge.
PURGE_BATCH = 256

#: Bytes a claim's two operations carry beside the data and the paths
#: (headers, version, ACL, flags), rounded up.
OP_OVERHEAD = 64

#: Most bytes one request (a multi) carries: ZooKeeper closes the connection of
#: a request bigger than its jute.maxbuffer (1 MiB by default).
REQUEST_BUDGET = 1_000_000

#: A multi's check of a node that must exist, whatever its data (ZooKeeper: -1).
ANY_VERSION = -1

def _in_place(bucket: str, names: list[str]) -> tuple[list[str], list[str]]:
    """Split the children of a bucket into the message names that belong there
    and the rest, as paths under ``unowned/``."""
    ours, foreign = [], []
    # Compared as numbers: formatting each name's bucket cost more than its parse.
    place = parse_bucket_name(bucket)
    for name in names:
        parsed = parse_message_name(name)
        if parsed is not None and (parsed.inverted_priority, parsed.generation) == place:
            ours.append(name)
        else:
            foreign.append(f"{bucket}/{name}")
    return ours, foreign

def creates(stat: ZnodeStat) -> int:
    """How many children a node ever had created: the sequence its next
    sequential child gets. ZooKeeper keeps that count and reports ``cversion``
    as creates plus deletes, i.e. ``2 * creates - children``."""
    return (stat.cversion + stat.numChildren) // 2

class ClientSource(Protocol):
    """Where a store gets its client (a new one after fork) and held-back writes:
    a :class:`~celery_zk.zk.session.ClientHandle` or a whole session."""

    @property
    def client(self) -> KazooClient: ...

    @property
    def deferred(self) -> Deferred: ...


@dataclass(frozen=True)
class Listing:
    """The head of a queue in delivery order, as :meth:`Queues.listing` found it."""

    names: list[str]     # ours, in delivery order
    foreign: list[str]   # names celery_zk did not write (to dead-letter)
    complete: bool = True   # every bucket was listed (else only the first ``want`` or so)


class Queues:
    """A root's queues, as one kazoo client (through its source) sees them:
    their directories, listing, size, purge and delete. :class:`.Publisher`
    and :class:`.Acks` make their changes through one."""

    def __init__(self, source: ClientSource, layout: Layout, options: ZKOptions) -> None:
        self.source = source
        self.layout = layout
        self.options = options

    @property
    def client(self) -> KazooClient:
        return self.source.client

    @property
    def deferred(self) -> Deferred:
        """Acks and offers wait here briefly (see Deferred): off the critical path.
        One per session, so a publish flushes what any user of it held back."""
        return self.source.deferred

    def commit(self, build: Callable[[TransactionRequest], object]) -> list[Any]:
        """Build and commit a transaction, rebuilt per retry (kazoo commits one once)."""
        client = self.client

        def attempt() -> list[Any]:
            txn = client.transaction()
            build(txn)
            return txn.commit()

        return client.retry(attempt)

    # -- declaration ------------------------------------------------------------
    def declare(self, queue: str, meta: bytes = b"{}", holder: str | None = None) -> bool:
        """Create the queue's directories; a no-op when they exist (idempotent).

        ``holder`` (auto-delete queues) is the declaring session's ephemeral
        node under ``holders/``, created in the same transaction, so the queue
        is never without a holder a sweeper could mistake for dead. Returns
        False when the queue already existed (nothing was created).
        """
        layout, client = self.layout, self.client
        directories = layout.queue_directories(queue)
        if holder is None and client.retry(client.exists, directories[-1]) is not None:
            return False   # looked up first: a refused multi is a synced transaction
        client.retry(client.ensure_path, layout.queues)

        def build(txn: TransactionRequest) -> None:
            txn.create(layout.queue(queue), meta)
            for path in directories:
                txn.create(path)
            if holder is not None:
                txn.create(layout.holders(queue))
                txn.create(holder, ephemeral=True)

        failure = multi_failure(self.commit(build))
        if failure and not isinstance(failure[1], NodeExistsError):
            raise failure[1]
        if failure and failure[0] == 0 and holder is None:
            # Declared by an earlier release, which made fewer directories.
            for path in directories:
                try:
                    client.retry(client.create, path)
                except NodeExistsError:
                    pass
        return failure is None

    def exists(self, queue: str) -> bool:
        return self.client.retry(self.client.exists, self.layout.unowned(queue)) is not None

    def buckets(self, queue: str) -> tuple[list[str], list[str]]:
        """``(buckets in delivery order, other names)`` in a queue's ``unowned/``."""
        client = self.client
        names = client.retry(client.get_children, self.layout.unowned(queue))
        buckets = sorted(name for name in names if parse_bucket_name(name) is not None)
        return buckets, [name for name in names if parse_bucket_name(name) is None]

    def size(self, queue: str) -> int:
        """Messages waiting, from the directories' stats alone (no message listing)."""
        return sum(stat.numChildren for _, stat in self.bucket_stats(queue))

    def bucket_stats(self, queue: str) -> list[tuple[str, ZnodeStat]]:
        """``(bucket, its stat)`` of each bucket of a queue, in delivery order,
        read together (one round trip after the listing of ``unowned/``)."""
        client = self.client
        try:
            buckets, _ = self.buckets(queue)
        except NoNodeError:
            return []
        paths = [self.layout.bucket(queue, bucket) for bucket in buckets]
        stats = [client.exists_async(path) for path in paths]
        found = [(bucket, reply_or_retry(client, result, client.exists, path))
                 for bucket, path, result in zip(buckets, paths, stats)]
        return [(bucket, stat) for bucket, stat in found if stat is not None]

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
                listed = client.retry(client.get_children, self.layout.bucket(queue, bucket))
            except NoNodeError:
                continue   # emptied and deleted meanwhile
            if not listed:
                if index + 1 < len(buckets) and same_priority(bucket, buckets[index + 1]):
                    self._delete_bucket(queue, bucket)   # nobody publishes to it again
                continue
            ours, theirs = _in_place(bucket, listed)
            names += ours
            foreign += theirs
        return Listing(sort_messages(names)[0], foreign, complete)

    def _delete_bucket(self, queue: str, bucket: str) -> None:
        """Delete an empty bucket, and its bodies' twin if that is empty too (a
        twin that still holds bodies of owned messages is left to :meth:`sweep_bodies`)."""
        self.delete_if_empty(self.layout.bucket(queue, bucket))
        self.delete_if_empty(self.layout.body_bucket(queue, bucket))

    def move(self, source: str, target: str) -> bool:
        """Move a message's name from ``source`` (an inbox, ``delayed/``) to
        ``target``, its place under ``unowned/``, in one multi that makes the
        bucket again if it was emptied and deleted meanwhile (the bucket sorts
        ahead of later ones, where the message belongs). False when ``source``
        was gone (acked, moved by someone else): the delete in the multi makes
        a double move impossible."""
        client = self.client
        bucket = self.layout.parent(target)
        make_bucket = False

        def attempt() -> bool:
            nonlocal make_bucket
            txn = client.transaction()
            # The create before the delete: a dispatcher learns of the message
            # waiting again before it sees the credit its delete frees (a
            # transaction's watch events come in the order of its operations),
            # so that credit never goes to what the message goes back ahead of.
            if make_bucket:
                txn.create(bucket)
            txn.create(target)
            txn.delete(source)
            try:
                failure = multi_failure(txn.commit())
            except ConnectionLoss:
                synced(client, source)
                if client.retry(client.exists, source) is None:
                    return True  # it committed (or another survivor moved it)
                raise
            if failure is None:
                return True
            index, error = failure
            if index == 0 and isinstance(error, NodeExistsError if make_bucket
                                         else NoNodeError):
                make_bucket = not make_bucket   # the bucket came or went meanwhile
                return attempt()
            if isinstance(error, (NoNodeError, NodeExistsError)):
                return False   # moved already (a retry, or another survivor)
            raise error

        return bool(client.retry(attempt))

    def delete_if_empty(self, path: str) -> None:
        """Delete a directory in the background, refused if something came
        meanwhile (whoever emptied it tries again at its next look)."""
        unwaited(self.client.delete_async(path), logger, "celery_zk: could not delete the "
                 "empty %s; the next look tries again", path,
                 expected=(NoNodeError, NotEmptyError))

    def sweep_bodies(self, queue: str, buckets: list[str]) -> None:
        """Delete the bodies' buckets whose bucket is gone (``buckets``: those of
        ``unowned/`` now) once their last body was acked; refused while not empty."""
        client = self.client
        present = set(buckets)
        for twin in children(client, self.layout.bodies(queue)):
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
            removed += self.delete_waiting(queue, names)
        return removed

    def delete_waiting(self, queue: str, names: list[str]) -> int:
        """Delete waiting messages (each name with its body), :data:`PURGE_BATCH`
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
                removed += self.end(layout.unowned_message(queue, name), queue, message) is None
            else:
                small.append(name)
        names = small
        for start in range(0, len(names), PURGE_BATCH):
            batch = names[start:start + PURGE_BATCH]
            if multi_failure(self.commit(deletes(batch))) is None:
                removed += len(batch)
                continue
            # One was given to a consumer meanwhile (or purged by someone else),
            # which refused the multi: the rest one by one.
            removed += sum(1 for name in batch
                           if multi_failure(self.commit(deletes([name]))) is None)
        return removed

    def end(self, path: str, queue: str, message: MessageName,
            check: str | None = None) -> tuple[int, Exception] | None:
        """Delete a message, its name at ``path`` (waiting or owned) and its body,
        in one multi that first checks ``check`` exists (an ack's consumer node:
        see :meth:`~celery_zk.broker.acks.Acks.ack`); a big one's chunks with
        them, as many as fit, the rest right after (:func:`commit_deleting`).
        The multi's failure (see :func:`multi_failure`), or None."""
        client, body = self.client, self.layout.body(queue, message)

        def build(txn: TransactionRequest) -> None:
            if check is not None:
                # Any version: the node's data (its queues) changes as consumers do.
                txn.check(check, ANY_VERSION)
            txn.delete(path)
            txn.delete(body)

        if not message.chunked:
            return multi_failure(self.commit(build))
        container = self.layout.chunk_container(queue, message.uid)
        return client.retry(lambda: commit_deleting(
            client, build, container_paths(client, container)))

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
        return children(self.client, self.layout.owned(queue))

    def queue_names(self) -> Iterable[str]:
        return [unescape(n) for n in children(self.client, self.layout.queues)]
