"""The queue protocol: put, claim, ack, requeue, dead-letter, purge.

Every state change that touches more than one node is one ``multi``
transaction, so a message is always in exactly one place (unowned, owned or
dead) whatever crashes in between. Operations are retried after
ConnectionLoss; because a lost reply does not say whether a transaction
committed, each retry first checks for the effect it was about to cause.
"""
from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import (
    BadVersionError,
    ConnectionLoss,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
)
from kazoo.protocol.paths import join
from kazoo.protocol.states import ZnodeStat

from .client import (
    Deferred,
    RedoThread,
    connected_retry,
    create_once,
    log_failure,
    multi_failure,
    reply_or_retry,
)
from .config import ZKOptions
from .dead import wrap
from .exceptions import MessageTooLarge
from .layout import (
    Layout,
    bucket_name,
    inverted,
    owned_name,
    parse_bucket_name,
    parse_message_name,
    requeued_name,
    same_priority,
    sort_messages,
    unescape,
)

logger = logging.getLogger(__name__)

#: Bytes a claim's two operations carry beside the data and the paths
#: (headers, version, ACL, flags), rounded up.
OP_OVERHEAD = 64
#: Most acks sent in one multi (a few dozen bytes each: far below jute.maxbuffer).
ACK_BATCH = 256
#: Most messages created in one multi by :meth:`QueueStore.put_batch`.
PUBLISH_BATCH = 256
#: A multi's check of a node that must exist, whatever its data (ZooKeeper: -1).
ANY_VERSION = -1


@dataclass
class ClaimCounts:
    """What this process's claims cost (for benchmarks and monitoring): the
    price of consumers contending for one queue's head."""

    transactions: int = 0   # claim multis sent
    conflicts: int = 0      # of those, refused because another consumer was first
    messages: int = 0       # messages claimed (hand-offs need no claim)


#: This process's counts (a forked child starts from its parent's: read the
#: difference).
CLAIMS = ClaimCounts()


@dataclass(frozen=True)
class Claimed:
    """A message this consumer now owns."""

    queue: str
    name: str          # unowned name it had
    owned_path: str    # where it lives while owned (the delivery tag)
    data: bytes


@dataclass(frozen=True)
class NewMessage:
    """A message about to be published."""

    queue: str
    uid: str      # the unique part of its name: finds it after a lost reply
    path: str     # the sequential node's prefix
    data: bytes
    inverted_priority: int
    generation: int   # the bucket it goes to
    affinity: str | None = None   # its affinity key, as named (layout.affinity_token)


@dataclass
class PendingClaim:
    """A claim sent without waiting (:meth:`QueueStore.claim_async`)."""

    queue: str
    consumer_id: str
    candidates: list[tuple[str, bytes, int]]   # (name, data, version), in order
    result: Any                                # the multi's async result (None: no multi)
    leftover: list[str]                        # not in this claim (did not fit, unread)

    def ready(self) -> bool:
        return self.result is None or bool(self.result.ready())


@dataclass(frozen=True)
class Listing:
    """The head of a queue in delivery order, as :meth:`QueueStore.listing` found it."""

    names: list[str]     # ours, in delivery order
    foreign: list[str]   # names celery_zk did not write (to dead-letter)


def _in_place(bucket: str | None, names: list[str]) -> tuple[list[str], list[str]]:
    """Split the children of a bucket (``None``: of ``unowned/`` itself) into the
    message names that belong there and the rest, as paths under ``unowned/``."""
    ours, foreign = [], []
    for name in names:
        parsed = parse_message_name(name)
        if parsed is not None and parsed.bucket == bucket:
            ours.append(name)
        else:
            foreign.append(f"{bucket}/{name}" if bucket else name)
    return ours, foreign


def creates(stat: ZnodeStat) -> int:
    """How many children a node ever had created: the sequence its next
    sequential child gets. ZooKeeper keeps that count and reports ``cversion``
    as creates plus deletes, i.e. ``2 * creates - children``."""
    return (stat.cversion + stat.numChildren) // 2


def new_uid() -> str:
    return uuid.uuid4().hex[:16]


class ClientSource(Protocol):
    """Where a store gets its client (a new one after fork) and held-back writes:
    a :class:`~celery_zk.session.ClientHandle` or a whole session."""

    @property
    def client(self) -> KazooClient: ...

    @property
    def deferred(self) -> Deferred: ...


class QueueStore:
    """Queue operations for one kazoo client under one root."""

    def __init__(self, source: ClientSource, layout: Layout, options: ZKOptions) -> None:
        self.source = source
        self.layout = layout
        self.options = options
        self._ack_retries: RedoThread[tuple[str, str]] = RedoThread(
            "celery_zk-ack-retry", self._ack_again)
        self._acks: list[tuple[str, str]] = []   # (owned path, consumer node) held back
        self._acks_lock = threading.Lock()
        # (queue, inverted priority) -> the bucket generation this process publishes to
        self._tails: dict[tuple[str, int], int] = {}
        # (queue, inverted priority) -> (bucket, creates seen in it): how much
        # room a batch may assume is left in the newest bucket.
        self._filled: dict[tuple[str, int], tuple[int, int]] = {}

    @property
    def client(self) -> KazooClient:
        return self.source.client

    @property
    def deferred(self) -> Deferred:
        """Acks and offers wait here briefly (see Deferred): off the critical path.
        One per session, so a publish flushes what any user of it held back."""
        return self.source.deferred

    def commit(self, build: Callable[[TransactionRequest], None]) -> list[Any]:
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
        client.retry(client.ensure_path, layout.queues)

        def build(txn: TransactionRequest) -> None:
            txn.create(layout.queue(queue), meta)
            for path in layout.queue_directories(queue):
                txn.create(path)
            if holder is not None:
                txn.create(layout.holders(queue))
                txn.create(holder, ephemeral=True)

        failure = multi_failure(self.commit(build))
        if failure and not isinstance(failure[1], NodeExistsError):
            raise failure[1]
        return failure is None

    def exists(self, queue: str) -> bool:
        return self.client.retry(self.client.exists, self.layout.unowned(queue)) is not None

    def size(self, queue: str) -> int:
        """Messages waiting, from the directories' stats alone (no message listing)."""
        client = self.client
        try:
            buckets, flat = self.buckets(queue)
        except NoNodeError:
            return 0
        stats = [client.exists_async(self.layout.bucket(queue, bucket)) for bucket in buckets]
        return len(flat) + sum(stat.numChildren for stat in (
            reply_or_retry(client, result, client.exists, self.layout.bucket(queue, bucket))
            for bucket, result in zip(buckets, stats)) if stat is not None)

    # -- publishing ---------------------------------------------------------------
    def check_size(self, data: bytes, what: str) -> None:
        limit = self.options.max_message_size
        if len(data) > limit:
            raise MessageTooLarge(
                f"{what} is {len(data):,} bytes; a ZooKeeper node holds at most "
                f"{limit:,} (option max_message_size; the server's jute.maxbuffer caps "
                "it near 1 MiB). Nothing was written. Send a reference to the data "
                "(a path or URL) instead of the data itself.")

    def put(self, queue: str, data: bytes, priority: int | None) -> str:
        """Append a message; returns its node name."""
        return self.put_new(self.new_message(queue, data, priority))

    def new_message(self, queue: str, data: bytes, priority: int | None,
                    affinity: str | None = None) -> NewMessage:
        """A message ready to publish (its size checked, its node named);
        ``affinity``: its key's :func:`~celery_zk.layout.affinity_token`."""
        self.check_size(data, f"A message for queue {queue!r}")
        inv = inverted(priority)
        generation = self._tails.get((queue, inv))
        if generation is None:
            generation = self._find_tail(queue, inv)
        return self._named(queue, new_uid(), data, inv, generation, affinity)

    def _named(self, queue: str, uid: str, data: bytes, inv: int, generation: int,
               affinity: str | None) -> NewMessage:
        # ZooKeeper appends the sequence to this prefix.
        path = self.layout.new_message_prefix(queue, inv, generation, uid, affinity)
        return NewMessage(queue, uid, path, data, inv, generation, affinity)

    def put_new(self, message: NewMessage, maybe_made: bool = False) -> str:
        """Create ``message``'s node once (``maybe_made``: an earlier create lost its reply)."""
        try:
            name = self._create_once(message, maybe_made)
        except NoNodeError:
            # Its bucket was emptied and deleted (or the queue never declared): go
            # to the queue's newest bucket of that priority.
            message = self._named(message.queue, message.uid, message.data,
                                  message.inverted_priority, self._newest_after(message),
                                  message.affinity)
            name = self._create_once(message, maybe_made)
        self.created(message, name)
        return name

    def created(self, message: NewMessage, name: str) -> None:
        """A publish made ``name``: once its bucket has had ``bucket_size`` creates,
        the next go to a new one (non-blocking: kazoo's thread may call it).

        The new bucket is created without waiting: ZooKeeper handles a session's
        requests in order, so it exists before this process's next message."""
        parsed = parse_message_name(name)
        if parsed is None:
            return
        key = (message.queue, message.inverted_priority)
        filled = self._filled.get(key)
        if filled is None or filled < (message.generation, parsed.seq + 1):
            self._filled[key] = (message.generation, parsed.seq + 1)
        if parsed.seq < self.options.bucket_size - 1:
            return
        following = message.generation + 1
        if self._tails.get(key, -1) >= following:
            return   # moved on already
        self._tails[key] = following
        self.client.create_async(self.layout.bucket(
            message.queue, bucket_name(message.inverted_priority, following)))

    def put_batch(self, messages: list[NewMessage]) -> list[str | None]:
        """Create the nodes of ``messages``, in order, up to :data:`PUBLISH_BATCH`
        per multi; their names (None: one consumed before a lost reply was checked).

        Each multi carries at most ``max_message_size`` and puts no more into a
        bucket than the room this process knows is left in it, so a batch keeps
        the bounds of single publishes. A multi is atomic: after a failure some
        earlier multis may have been stored, never part of one.
        """
        names: list[str | None] = []
        rest = messages
        while rest:
            chunk = self._next_chunk(rest)
            names.extend(self._put_chunk(chunk))
            rest = rest[len(chunk):]
        return names

    def _next_chunk(self, messages: list[NewMessage]) -> list[NewMessage]:
        """The next multi's messages, named for their queues' newest buckets."""
        budget = self.options.max_message_size
        chunk: list[NewMessage] = []
        room: dict[tuple[str, int], int] = {}
        for message in messages[:PUBLISH_BATCH]:
            key = (message.queue, message.inverted_priority)
            if key not in room:
                generation = self._tails.get(key)
                if generation is None:
                    generation = self._find_tail(*key)
                seen, filled = self._filled.get(key, (generation, 0))
                room[key] = self.options.bucket_size - (filled if seen == generation else 0)
            else:
                generation = self._tails[key]
            budget -= len(message.data) + len(message.path) + OP_OVERHEAD
            if chunk and (budget < 0 or room[key] <= 0):
                break   # the rest go in the next multi, after a roll to a new bucket
            room[key] -= 1
            chunk.append(message if message.generation == generation else
                         self._named(message.queue, message.uid, message.data,
                                     message.inverted_priority, generation,
                                     message.affinity))
        return chunk

    def _put_chunk(self, chunk: list[NewMessage]) -> list[str | None]:
        """One multi creating ``chunk``'s nodes, retried as :meth:`put_new` retries."""
        client = self.client
        maybe_made = False

        def attempt() -> list[str | None] | None:
            nonlocal maybe_made
            if maybe_made:   # a lost reply: a multi is all or nothing, so look for any
                found = self._find_uids(chunk)
                if any(found):
                    return found
            txn = client.transaction()
            for message in chunk:
                txn.create(message.path, message.data, sequence=True)
            maybe_made = True
            results = txn.commit()
            maybe_made = False
            failure = multi_failure(results)
            if failure is None:
                return [path.rpartition("/")[2] for path in results]
            if isinstance(failure[1], NoNodeError):
                self._rename_to_tail(chunk, chunk[failure[0]])   # its bucket is gone
                return None
            raise failure[1]

        for _ in range(3):
            names = connected_retry(client, attempt)
            if names is not None:
                for message, name in zip(chunk, names):
                    if name is not None:
                        self.created(message, name)
                return names
        raise NoNodeError(f"celery_zk: the buckets of queue {chunk[0].queue!r} kept "
                          "disappearing while publishing to it")

    def _rename_to_tail(self, chunk: list[NewMessage], gone: NewMessage) -> None:
        """``gone``'s bucket was emptied and deleted (or its queue never declared):
        its queue's messages of that priority in ``chunk`` go to the newest one."""
        key = (gone.queue, gone.inverted_priority)
        generation = self._newest_after(gone)
        for index, message in enumerate(chunk):
            if (message.queue, message.inverted_priority) == key:
                chunk[index] = self._named(message.queue, message.uid, message.data,
                                           message.inverted_priority, generation,
                                           message.affinity)

    def _newest_after(self, gone: NewMessage) -> int:
        """The newest bucket of ``gone``'s queue and priority, looked up again now
        that ``gone``'s bucket turned out to be missing."""
        self._tails.pop((gone.queue, gone.inverted_priority), None)
        return max(gone.generation, self._find_tail(gone.queue, gone.inverted_priority))

    def _find_uids(self, chunk: list[NewMessage]) -> list[str | None]:
        """The stored names of ``chunk``'s messages (None where not found)."""
        found: dict[str, str] = {}
        for parent in {self.layout.parent(message.path) for message in chunk}:
            try:
                names = self.client.get_children(parent)
            except NoNodeError:
                continue
            for name in names:
                parsed = parse_message_name(name)
                if parsed is not None:
                    found[parsed.uid] = name
        return [found.get(message.uid) for message in chunk]

    def _find_tail(self, queue: str, inv: int) -> int:
        """The newest bucket of a priority, made if there is none (or it is full)."""
        layout, client = self.layout, self.client
        try:
            names = client.retry(client.get_children, layout.unowned(queue))
        except NoNodeError:
            self.declare(queue)   # first message to an undeclared queue
            names = []
        generations = [parsed[1] for parsed in map(parse_bucket_name, names)
                       if parsed is not None and parsed[0] == inv]
        generation = max(generations, default=0)
        stat = (client.retry(client.exists, layout.bucket(queue, bucket_name(inv, generation)))
                if generations else None)
        if stat is not None and creates(stat) >= self.options.bucket_size:
            generation += 1
            stat = None
        if stat is None:
            try:
                client.retry(client.create, layout.bucket(queue, bucket_name(inv, generation)))
            except NodeExistsError:
                pass
            except NoNodeError:   # the queue was deleted meanwhile: declare it again
                self.declare(queue)
                return self._find_tail(queue, inv)
        self._tails[(queue, inv)] = generation
        self._filled[(queue, inv)] = (generation, creates(stat) if stat is not None else 0)
        return generation

    def _create_once(self, message: NewMessage, maybe_made: bool) -> str:
        client = self.client
        return create_once(
            client, lambda: client.create(message.path, message.data,
                                          sequence=True).rpartition("/")[2],
            lambda: self._find_uid(message), maybe_made)

    def _find_uid(self, message: NewMessage) -> str | None:
        return self._find_uids([message])[0]

    def buckets(self, queue: str, watch: Callable[[Any], None] | None = None
                ) -> tuple[list[str], list[str]]:
        """``(buckets in delivery order, other names)`` in a queue's ``unowned/``."""
        client = self.client
        names = client.retry(client.get_children, self.layout.unowned(queue), watch=watch)
        buckets = sorted(name for name in names if parse_bucket_name(name) is not None)
        return buckets, [name for name in names if parse_bucket_name(name) is None]

    # -- consuming ----------------------------------------------------------------
    def listing(self, queue: str, want: int,
                watch: Callable[[Any], None] | None = None) -> Listing:
        """The first ``want`` (or a few more) waiting messages of a queue, in
        delivery order, from names alone.

        Lists ``unowned/`` and then its buckets in order until ``want`` names
        are found; ``watch`` is set on every directory listed, so an empty
        result is fully watched. An empty bucket with a later one of its
        priority is deleted: no publisher will come back to it.
        """
        client = self.client
        path = self.layout.unowned(queue)
        while True:
            try:
                buckets, flat = self.buckets(queue, watch)
            except NoNodeError:
                # No listing watch on a missing node: watch for its creation instead
                # (a deleted auto-delete queue its owner re-declares after an expiry).
                if watch is None or client.retry(client.exists, path, watch=watch) is None:
                    return Listing([], [])
                continue  # created meanwhile: list it
            break
        names, foreign = _in_place(None, flat)
        for index, bucket in enumerate(buckets):
            if len(names) >= want:
                break
            try:
                children = client.retry(client.get_children, self.layout.bucket(queue, bucket),
                                        watch=watch)
            except NoNodeError:
                continue   # emptied and deleted meanwhile
            if not children:
                if index + 1 < len(buckets) and same_priority(bucket, buckets[index + 1]):
                    self._delete_bucket(queue, bucket)   # nobody publishes to it again
                continue
            ours, theirs = _in_place(bucket, children)
            names += ours
            foreign += theirs
        return Listing(sort_messages(names)[0], foreign)

    def _delete_bucket(self, queue: str, bucket: str) -> None:
        """Delete an empty bucket in the background (refused if a message came)."""
        def done(result: Any) -> None:   # kazoo's thread: never block
            try:
                result.get()
            except (NoNodeError, NotEmptyError):
                pass
            except Exception as exc:
                log_failure(logger, exc, "celery_zk: could not delete the empty bucket "
                            "%s of queue %r; the next listing tries again", bucket, queue)
        self.client.delete_async(self.layout.bucket(queue, bucket)).rawlink(done)

    def read_async(self, queue: str, name: str) -> Any:
        """Start reading a waiting message (pipelined; not from a tree-watch callback,
        which runs on kazoo's connection thread: see celery_zk.queue_view)."""
        return self.client.get_async(self.layout.unowned_message(queue, name))

    def read_owned(self, owned_path: str) -> tuple[bytes, Any]:
        client = self.client
        return client.retry(client.get, owned_path)

    def claim(self, queue: str, names: list[str], consumer_id: str,
              reads: dict[str, Any] | None = None) -> tuple[list[Claimed], set[str]]:
        """Move ``names`` from unowned to owned in one transaction.

        ``reads``: reads of some of them already under way (:meth:`read_async`).
        Returns what was claimed and the names another consumer took first;
        the others did not fit in one request (see :meth:`_fitting`).
        """
        layout, client = self.layout, self.client
        gone: set[str] = set()
        reads = reads or {}
        pending = [(n, reads.pop(n, None) or client.get_async(layout.unowned_message(queue, n)))
                   for n in names]
        candidates: list[tuple[str, bytes, int]] = []
        for name, result in pending:
            try:
                data, stat = reply_or_retry(client, result, client.get,
                                            layout.unowned_message(queue, name))
            except NoNodeError:
                gone.add(name)
            else:
                candidates.append((name, data, stat.version))
        candidates = self._fitting(queue, consumer_id, candidates)
        while candidates:
            claimed, lost = self._settle_claim(
                queue, consumer_id, candidates, self._send_claim(queue, consumer_id, candidates))
            if claimed is not None:
                return claimed, gone
            if lost is not None:
                gone.add(candidates.pop(lost)[0])
        return [], gone

    def claim_async(self, queue: str, names: list[str], consumer_id: str,
                    reads: dict[str, Any]) -> PendingClaim | None:
        """Send the claim of ``names`` without waiting for it (see :meth:`claim`).

        Only when every one of their reads (``reads``) has landed: the
        transaction needs their data and versions, and this never blocks.
        Otherwise nothing is sent and None returned. :meth:`finish_claim`
        gives the outcome. A name found gone is simply not claimed.
        """
        if not names or any(name not in reads or not reads[name].ready() for name in names):
            return None
        candidates: list[tuple[str, bytes, int]] = []
        unread: list[str] = []
        for name in names:
            try:
                data, stat = reads.pop(name).get()
            except NoNodeError:
                continue   # gone: another consumer took it
            except Exception:
                unread.append(name)   # a lost reply: read again by a later claim
            else:
                candidates.append((name, data, stat.version))
        fitting = self._fitting(queue, consumer_id, candidates)
        leftover = [name for name, _, _ in candidates[len(fitting):]] + unread
        result = self._send_claim(queue, consumer_id, fitting) if fitting else None
        return PendingClaim(queue, consumer_id, fitting, result, leftover)

    def finish_claim(self, pending: PendingClaim) -> tuple[list[Claimed], list[str]]:
        """Wait for a claim :meth:`claim_async` sent: ``(claimed, not claimed)``.

        The names not claimed are still waiting (the transaction is all or
        nothing): they go back to the listing.
        """
        candidates = pending.candidates
        if not candidates:
            return [], pending.leftover
        claimed, lost = self._settle_claim(pending.queue, pending.consumer_id, candidates,
                                           pending.result)
        if claimed is not None:
            return claimed, pending.leftover
        names = [name for index, (name, _, _) in enumerate(candidates) if index != lost]
        return [], names + pending.leftover

    def _send_claim(self, queue: str, consumer_id: str,
                    candidates: list[tuple[str, bytes, int]]) -> Any:
        """Send one claim transaction; its async result."""
        layout, txn = self.layout, self.client.transaction()
        for name, data, version in candidates:
            # Without the transaction a crash between delete and create would
            # lose the message; with it the message is unowned or owned, never neither.
            txn.delete(layout.unowned_message(queue, name), version=version)
            txn.create(layout.owned_message(queue, owned_name(consumer_id, name)), data)
        CLAIMS.transactions += 1
        return txn.commit_async()

    def _settle_claim(self, queue: str, consumer_id: str,
                      candidates: list[tuple[str, bytes, int]], result: Any
                      ) -> tuple[list[Claimed] | None, int | None]:
        """The outcome of a claim :meth:`_send_claim` sent: ``(claimed, None)``
        when it committed, ``(None, index)`` when another consumer took the
        candidate at ``index`` first, ``(None, None)`` when it did not commit."""
        layout, client = self.layout, self.client
        try:
            results = result.get()
        except ConnectionLoss:
            # Did it commit? The first create tells (the multi is all or nothing).
            first = layout.owned_message(queue, owned_name(consumer_id, candidates[0][0]))
            if client.retry(client.exists, first) is None:
                return None, None
            results = []
        failure = multi_failure(results)
        if failure is None:
            CLAIMS.messages += len(candidates)
            return [Claimed(queue, name, layout.owned_message(
                queue, owned_name(consumer_id, name)), data)
                for name, data, _ in candidates], None
        index, error = failure
        if not isinstance(error, (NoNodeError, BadVersionError, NodeExistsError)):
            raise error
        CLAIMS.conflicts += 1
        return None, index // 2   # two ops per candidate

    def _fitting(self, queue: str, consumer_id: str,
                 candidates: list[tuple[str, bytes, int]]) -> list[tuple[str, bytes, int]]:
        """The first candidates whose claim fits in one request.

        ZooKeeper closes the connection of a request larger than its
        ``jute.maxbuffer``, so a multi carrying several big messages would
        fail forever; what does not fit stays waiting for the next claim.
        """
        layout = self.layout
        budget = self.options.max_message_size
        for index, (name, data, _) in enumerate(candidates):
            budget -= (len(data) + len(layout.unowned_message(queue, name))
                       + len(layout.owned_message(queue, owned_name(consumer_id, name)))
                       + OP_OVERHEAD)
            if budget < 0 and index > 0:
                return candidates[:index]
        return candidates

    def _ack_ops(self, owned_path: str, consumer_node: str) -> Callable[[TransactionRequest], None]:
        def build(txn: TransactionRequest) -> None:
            # The check makes an ack from an expired session a no-op: by then a
            # survivor may have requeued the message and another worker holds it.
            # Any version: the node's data (its queues) changes as consumers do.
            txn.check(consumer_node, ANY_VERSION)
            txn.delete(owned_path)
        return build

    def _ack_outcome(self, owned_path: str, consumer_node: str, results: list[Any]) -> bool:
        failure = multi_failure(results)
        if failure is None:
            return True
        if failure[0] == 0:
            logger.warning(
                "celery_zk: not acking %s: this worker's ZooKeeper session %s ended, so "
                "the message was requeued and will run again (at-least-once).",
                owned_path, consumer_node)
        return False

    def ack(self, owned_path: str, consumer_node: str) -> bool:
        """Delete an owned message if the session that claimed it still lives."""
        try:
            results = self.commit(self._ack_ops(owned_path, consumer_node))
        except NoNodeError:
            return False
        return self._ack_outcome(owned_path, consumer_node, results)

    def ack_async(self, owned_path: str, consumer_node: str) -> None:
        """:meth:`ack` without waiting for ZooKeeper, as AMQP's basic.ack.

        The task runs while the ack commits. It is sent after a short delay
        (:attr:`deferred`), so it does not hold up the task's own writes, and
        together with the other acks of that moment in one multi (a busy worker
        acks a prefetch's worth at a time). If the worker dies in between, the
        message is redelivered (at-least-once). If the reply is lost the ack is
        redone by a background thread that waits for the reconnect; until it
        lands the message stays owned, so nothing is lost either way.
        """
        with self._acks_lock:
            first = not self._acks
            self._acks.append((owned_path, consumer_node))
        if first:
            self.deferred.later(self._send_acks)

    def _send_acks(self) -> None:
        with self._acks_lock:
            acks, self._acks = self._acks, []
        by_owner: dict[str, list[str]] = {}
        for owned_path, consumer_node in acks:
            by_owner.setdefault(consumer_node, []).append(owned_path)
        for consumer_node, paths in by_owner.items():
            for start in range(0, len(paths), ACK_BATCH):
                self._send_ack_batch(consumer_node, paths[start:start + ACK_BATCH])

    def _send_ack_batch(self, consumer_node: str, paths: list[str]) -> None:
        """One multi: the owner's session is alive (the check), and every message goes."""
        txn = self.client.transaction()
        txn.check(consumer_node, ANY_VERSION)
        for owned_path in paths:
            txn.delete(owned_path)

        def done(result: Any) -> None:  # kazoo's event thread: never block here
            try:
                results = result.get()
            except Exception:
                for owned_path in paths:
                    self._ack_retries.submit((owned_path, consumer_node))
                return
            failure = multi_failure(results)
            if failure is None:
                return
            if failure[0] == 0:   # the session ended: every one of them was requeued
                for owned_path in paths:
                    self._ack_outcome(owned_path, consumer_node, results)
                return
            # One message was gone already (a requeue raced the ack, say), which
            # refused the whole multi: ack the others one by one.
            for index, owned_path in enumerate(paths, start=1):
                if index != failure[0]:
                    self._ack_retries.submit((owned_path, consumer_node))

        txn.commit_async().rawlink(done)

    def _ack_again(self, item: tuple[str, str]) -> None:
        owned_path, consumer_node = item
        try:
            self.ack(owned_path, consumer_node)
        except Exception as exc:  # the session's end will requeue it: at-least-once
            log_failure(logger, exc, "celery_zk: could not ack %s; it will be redelivered "
                        "when this worker's session ends", owned_path)

    def requeue(self, owned_path: str, data: bytes | None = None,
                expected_version: int = -1) -> bool:
        """Move an owned message back to unowned, ahead of newer messages of its priority.

        ``data=None`` reads it from the owned node (recovery of a dead owner).
        Returns False when the message was no longer there (acked, or requeued
        by someone else): the delete in the same transaction makes a double
        requeue impossible.
        """
        layout, client = self.layout, self.client
        queue, _, name = layout.split_owned_path(owned_path)
        message = parse_message_name(name)
        assert message is not None  # split_owned_path validated the name
        if data is None:
            try:
                data, stat = client.retry(client.get, owned_path)
            except NoNodeError:
                return False
            expected_version = stat.version
        # Not sequential: the uid makes the name unique (one copy of a message
        # exists at a time), and no bucket's counter moves.
        path = layout.unowned_message(queue, requeued_name(message))

        bucket = layout.parent(path)
        make_bucket = False

        def move() -> bool:
            nonlocal make_bucket
            txn = client.transaction()
            txn.delete(owned_path, version=expected_version)
            if make_bucket:
                txn.create(bucket)
            txn.create(path, data)
            try:
                failure = multi_failure(txn.commit())
            except ConnectionLoss:
                if client.retry(client.exists, owned_path) is None:
                    return True  # it committed (or another survivor moved it)
                raise
            if failure is None:
                return True
            index, error = failure
            if index == 1 and isinstance(error, NoNodeError if not make_bucket
                                         else NodeExistsError):
                # Its bucket was emptied and deleted since (make it again, in the
                # same transaction: it sorts ahead of later buckets, where the
                # message belongs), or made again meanwhile.
                make_bucket = not make_bucket
                return move()
            if isinstance(error, (NoNodeError, BadVersionError)):
                return False
            raise error

        return bool(client.retry(move))

    def remove(self, owned_path: str, dead_letter: bool, reason: str = "") -> bool:
        """Drop an owned message, or move it to the queue's dead/ directory."""
        layout, client = self.layout, self.client
        if not dead_letter:
            try:
                client.retry(client.delete, owned_path)
                return True
            except NoNodeError:
                return False
        queue, _, name = layout.split_owned_path(owned_path)
        return self._move_to_dead(owned_path, layout.dead_message(queue, name), reason)

    def discard(self, owned_path: str) -> None:
        """Delete an owned message without waiting for the reply (no_ack consumers)."""
        def done(result: Any) -> None:
            try:
                result.get()
            except NoNodeError:
                pass
            except Exception as exc:  # the owner's session end requeues it: at-least-once
                log_failure(logger, exc, "celery_zk: could not delete no-ack message %s",
                            owned_path)
        self.client.delete_async(owned_path).rawlink(done)

    def dead_letter_unowned(self, queue: str, name: str, reason: str) -> bool:
        """Move a node we cannot deliver out of the way, so it is not retried forever.
        ``name``: as listed (``bucket/name`` for a foreign node inside a bucket)."""
        return self._move_to_dead(self.layout.unowned_message(queue, name),
                                  self.layout.dead_message(queue, name), reason)

    def _move_to_dead(self, source: str, target: str, reason: str) -> bool:
        client = self.client
        try:
            data, stat = client.retry(client.get, source)
        except NoNodeError:
            return False

        def build(txn: TransactionRequest) -> None:
            txn.delete(source, version=stat.version)
            txn.create(target, wrap(data, reason))   # the reason is kept (celery_zk.dead)

        failure = multi_failure(self.commit(build))
        if failure is None:
            logger.error("celery_zk: moved %s to %s: %s", source, target, reason)
            return True
        if isinstance(failure[1], NodeExistsError):  # a retry after it committed
            return False
        if isinstance(failure[1], (NoNodeError, BadVersionError)):
            return False
        raise failure[1]

    # -- maintenance --------------------------------------------------------------
    def purge(self, queue: str) -> int:
        """Delete every waiting (unowned) message; owned ones are being worked on.
        One bucket at a time, so a huge backlog is never listed at once."""
        client, layout = self.client, self.layout
        try:
            buckets, flat = self.buckets(queue)
        except NoNodeError:
            return 0
        removed = self.delete_all([layout.unowned_message(queue, name) for name in flat])
        for bucket in buckets:
            path = layout.bucket(queue, bucket)
            try:
                names = client.retry(client.get_children, path)
            except NoNodeError:
                continue
            removed += self.delete_all([join(path, name) for name in names])
        return removed

    def delete_all(self, paths: list[str]) -> int:
        """Pipelined deletes; how many this call deleted."""
        client = self.client
        removed = 0
        for result in [client.delete_async(path) for path in paths]:
            try:
                result.get()
                removed += 1
            except NoNodeError:
                pass  # claimed or purged by someone else meanwhile
        return removed

    def delete(self, queue: str) -> None:
        """Remove a queue and everything in it (messages included)."""
        client = self.client
        for _ in range(5):
            try:
                client.retry(client.delete, self.layout.queue(queue), recursive=True)
                return
            except NoNodeError:
                return
            except NotEmptyError:  # a message arrived while deleting; go again
                continue

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
