"""Publishing: a message is two nodes made in one multi, its body in
``bodies/{bucket}/{uid}`` and its (empty) sequential name in the queue's newest
bucket of its priority, so that from then on only the name moves; created
once even when a reply is lost; a group's in a few multis."""
from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import (
    NodeExistsError,
    NoNodeError,
)

from ..exceptions import MessageTooLarge
from ..zk.client import (
    connected_retry,
    listings,
    multi_failure,
    synced,
)
from ..zk.layout import Layout
from ..zk.message_names import (
    BODY_APART,
    BODY_CHUNKED,
    bucket_name,
    delayed_bucket,
    delayed_uid,
    inverted,
    parse_bucket_name,
    parse_message_name,
)
from ..zk.payload import needs_chunks
from .big import State, mark, prepare
from .queues import OP_OVERHEAD, REQUEST_BUDGET, Queues, creates

logger = logging.getLogger(__name__)

#: Most messages created in one multi by :meth:`Publisher.put_batch`.
PUBLISH_BATCH = 256

@dataclass(frozen=True)
class NewMessage:
    """A message about to be published."""

    queue: str
    uid: str      # the unique part of its name: finds it after a lost reply
    path: str     # the sequential name's prefix
    body_path: str   # where its body goes (bodies/{bucket}/{uid})
    data: bytes   # the body, or for a big one the manifest of its chunks
    inverted_priority: int
    generation: int   # the bucket it goes to
    affinity: str | None = None   # its affinity key, as named (layout.affinity_token)
    kind: str = BODY_APART   # BODY_CHUNKED: its chunks are written (celery_zk.broker.big)
    task: str | None = None        # its task's token (layout.task_token): for limits
    limit_key: str | None = None   # its concurrency key's token (layout.limit_key_token)
    size: int | None = None   # its body's bytes, named: the queue has x-max-length-bytes
    due: int | None = None   # delayed until then (ms since the epoch): path is under delayed/
    delayed_generation: int = 0   # the generation of its delayed bucket

    @property
    def big(self) -> bool:
        return self.kind == BODY_CHUNKED

    @property
    def ops(self) -> int:
        """How many operations :meth:`add_to` adds (the name's is the last)."""
        return 3 if self.big else 2

    def add_to(self, txn: TransactionRequest, layout: Layout) -> None:
        """The creates of a publish. One multi: a name never exists without its
        body (a consumer given it could not run it) nor a body without a name
        (nothing would ever delete it); a big one's chunks are marked live in
        it (not an orphan any more)."""
        txn.create(self.body_path, self.data)
        if self.big:
            mark(txn, layout, self.queue, self.uid, State.LIVE, self.data,
                 bucket_name(self.inverted_priority, self.generation))
        txn.create(self.path, b"", sequence=True)

class _MarkerExists(Exception):
    """A :meth:`Publishing.put_once` whose marker exists."""


class _NoMarkerParent(Exception):
    """A :meth:`Publishing.put_once` whose marker's parent is missing."""


def new_uid() -> str:
    return uuid.uuid4().hex[:16]

class Publisher:
    """put, put_new, put_batch: messages stored in a root's queues."""

    def __init__(self, queues: Queues,
                 names_size: Callable[[str], bool] = lambda queue: False) -> None:
        self.queues = queues
        self.layout = queues.layout
        self.options = queues.options
        #: Whether a queue's names carry their body's size (x-max-length-bytes).
        self.names_size = names_size
        # (queue, inverted priority) -> the bucket generation this process publishes to
        self._tails: dict[tuple[str, int], int] = {}
        # (queue, inverted priority) -> (bucket, creates seen in it): how much
        # room a batch may assume is left in the newest bucket.
        self._filled: dict[tuple[str, int], tuple[int, int]] = {}
        # (queue, delayed bucket's day and minute) -> the generation this process
        # delays its messages to: climbs as unowned/'s do, from 0 (no lookup).
        self._delayed_tails: dict[tuple[str, tuple[str, str]], int] = {}

    @property
    def client(self) -> KazooClient:
        return self.queues.client

    def check_size(self, data: bytes | int, what: str) -> None:
        """``data``: the message, or the size of its body as the application
        sent it (as AMQP brokers count a message's size)."""
        limit = self.options.max_message_size
        size = data if isinstance(data, int) else len(data)
        if size > limit:
            raise MessageTooLarge(
                f"{what} is {size:,} bytes, over the limit of {limit:,} (option "
                "max_message_size; each byte is in the memory of every ZooKeeper "
                "server, see docs/sizing.md). Nothing was written. Send a reference "
                "to the data (a path or URL) instead of the data itself, or raise "
                "max_message_size.")

    def put(self, queue: str, data: bytes, priority: int | None) -> str:
        """Append a message; returns its node name."""
        return self.put_new(self.new_message(queue, data, priority))

    def new_message(self, queue: str, data: bytes, priority: int | None,
                    affinity: str | None = None, size: int | None = None,
                    task: str | None = None, limit_key: str | None = None,
                    due: int | None = None) -> NewMessage:
        """A message ready to publish (its size checked, its node named);
        ``affinity``: its key's :func:`~celery_zk.zk.message_names.affinity_token`;
        ``size``: its body's size, checked against the limit (default: all of
        ``data``); ``due``: it waits under delayed/ until then (ms since the
        epoch, see :mod:`celery_zk.broker.delayed`)."""
        size = len(data) if size is None else size
        self.check_size(size, f"A message for queue {queue!r}")
        inv = inverted(priority)
        generation = self._tails.get((queue, inv))
        if generation is None:
            generation = self._find_tail(queue, inv)
        uid, kind = new_uid() if due is None else delayed_uid(due, new_uid()), BODY_APART
        if needs_chunks(data, self.options.chunk_size):
            # Its chunks first: nothing leads to them until the publish's multi.
            data = prepare(self.client, self.layout, queue, uid, data, self.options.chunk_size)
            kind = BODY_CHUNKED
        return self._named(queue, uid, data, inv, generation, affinity, kind, task, limit_key,
                           size if self.names_size(queue) else None, due)

    def _named(self, queue: str, uid: str, data: bytes, inv: int, generation: int,
               affinity: str | None, kind: str = BODY_APART, task: str | None = None,
               limit_key: str | None = None, size: int | None = None,
               due: int | None = None) -> NewMessage:
        # ZooKeeper appends the sequence to this prefix.
        delayed_generation = 0
        if due is None:
            path = self.layout.new_message_prefix(queue, inv, generation, uid, affinity, kind,
                                                  task, limit_key, size)
        else:
            delayed_generation = self._delayed_tails.get((queue, delayed_bucket(due, 0)), 0)
            path = self.layout.new_delayed_prefix(queue, due, delayed_generation, inv,
                                                  generation, uid, affinity, kind, task,
                                                  limit_key, size)
        return NewMessage(queue, uid, path, self.layout.new_body(queue, inv, generation, uid),
                          data, inv, generation, affinity, kind, task, limit_key, size, due,
                          delayed_generation)

    def renamed(self, message: NewMessage, generation: int) -> NewMessage:
        """``message`` bound for another bucket of its queue and priority."""
        return self._named(message.queue, message.uid, message.data,
                           message.inverted_priority, generation, message.affinity,
                           message.kind, message.task, message.limit_key, message.size,
                           message.due)

    def put_new(self, message: NewMessage, maybe_made: bool = False) -> str:
        """Store ``message`` once (``maybe_made``: an earlier attempt lost its reply)."""
        name = self._put_chunk([message], maybe_made)[0]
        if name is None:   # cannot be: one message's multi either stored it or not
            raise RuntimeError(f"celery_zk: the publish of {message.uid} left no trace")
        return name

    def put_once(self, message: NewMessage, marker: str) -> str | None:
        """Store ``message`` and make ``marker`` in one multi; None, storing
        nothing, when ``marker`` exists (the message was published before: a
        chord's body whose sender stopped before it could say so). A marker
        whose parent is gone guards nothing: the message is stored alone."""
        try:
            name = self._put_chunk([message], once=marker)[0]
        except _MarkerExists:
            return None
        except _NoMarkerParent:
            logger.info("celery_zk: %s cannot be made (its parent is gone); publishing "
                        "%s without it", marker, message.uid)
            return self.put_new(message)
        if name is None:   # cannot be: one message's multi either stored it or not
            raise RuntimeError(f"celery_zk: the publish of {message.uid} left no trace")
        return name

    def created(self, message: NewMessage, name: str) -> None:
        """A publish made ``name``: once its bucket has had ``bucket_size`` creates,
        the next go to a new one (non-blocking: kazoo's thread may call it).

        The new bucket is created without waiting: ZooKeeper handles a session's
        requests in order, so it exists before this process's next message."""
        parsed = parse_message_name(name)
        if parsed is None:
            return
        if message.due is not None:   # its delayed bucket's generation, as below
            if parsed.seq >= self.options.bucket_size - 1:
                tail = (message.queue, delayed_bucket(message.due, 0))
                following = message.delayed_generation + 1
                if len(self._delayed_tails) >= 1024:   # minutes long gone among them:
                    self._delayed_tails.clear()         # each climbs again, one create a step
                self._delayed_tails[tail] = max(self._delayed_tails.get(tail, 0), following)
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
        bucket = bucket_name(message.inverted_priority, following)
        self.client.create_async(self.layout.bucket(message.queue, bucket))
        self.client.create_async(self.layout.body_bucket(message.queue, bucket))

    def put_batch(self, messages: list[NewMessage]) -> list[str | None]:
        """Create the nodes of ``messages``, in order, up to :data:`PUBLISH_BATCH`
        per multi; their names (None: one consumed before a lost reply was checked).

        Each multi carries at most :data:`REQUEST_BUDGET` and puts no more into a
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
        budget = REQUEST_BUDGET
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
            budget -= (len(message.data) + len(message.path) + len(message.body_path)
                       + message.ops * OP_OVERHEAD)
            if chunk and (budget < 0 or (message.due is None and room[key] <= 0)):
                break   # the rest go in the next multi, after a roll to a new bucket
            if message.due is None:   # a delayed one's name goes elsewhere
                room[key] -= 1
            chunk.append(message if message.generation == generation else
                         self.renamed(message, generation))
        return chunk

    def _put_chunk(self, chunk: list[NewMessage], maybe_made: bool = False,
                   once: str | None = None) -> list[str | None]:
        """One multi storing ``chunk``'s messages, retried after a lost reply
        without storing any twice (each is found again by its uid); ``once``:
        a node the multi makes first (see :meth:`put_once`)."""
        client = self.client

        def attempt() -> list[str | None] | None:
            nonlocal maybe_made
            if maybe_made:   # a lost reply: a multi is all or nothing, so look for any
                synced(client, chunk[0].path.rpartition("/")[0])
                found = self._find_uids(chunk)
                if any(found):
                    return found
                # Stored, and already given to a consumer (the dispatcher moves a
                # name within milliseconds): still in its inbox unless acked.
                found = self._find_in_inboxes(chunk)
                if any(found):
                    return found
                logger.warning(
                    "celery_zk: the reply to a publish was lost and its message(s) %s are "
                    "not stored; publishing again (had they been stored and already "
                    "consumed and acked, they run twice: at-least-once)",
                    ", ".join(message.uid for message in chunk[:8]))
            txn = client.transaction()
            if once is not None:
                txn.create(once)
            ends = []   # the index of each message's last op: its name's create
            for message in chunk:
                message.add_to(txn, self.layout)
                ends.append(len(txn.operations) - 1)
            looked, maybe_made = maybe_made, True
            results = txn.commit()
            maybe_made = False
            failure = multi_failure(results)
            if failure is None:
                return [results[end].rpartition("/")[2] for end in ends]
            if once is not None and failure[0] == 0:
                # Made by an earlier publish: ours whose reply was lost and whose
                # message was consumed since (not found above), or another's.
                if isinstance(failure[1], NodeExistsError):
                    raise _MarkerExists()
                if isinstance(failure[1], NoNodeError):
                    raise _NoMarkerParent()
            if looked and isinstance(failure[1], NodeExistsError):
                # A body of ours exists: the lost attempt was stored after all and
                # its name moved between our lookup and this multi. Look again.
                maybe_made = True
                return None
            if isinstance(failure[1], NoNodeError):
                failed = next(i for i, end in enumerate(ends) if failure[0] <= end)
                if chunk[failed].due is not None and failure[0] == ends[failed]:
                    # The first message due in its minute (the bucket is made by
                    # it), or its bucket was promoted and deleted since: make it.
                    self._create_if_missing(self.layout.parent(chunk[failed].path),
                                            makepath=True)
                    return None
                # Its bucket (or the bodies' twin) is gone: deleted when empty.
                self._rename_to_tail(chunk, chunk[failed])
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
                chunk[index] = self.renamed(message, generation)

    def _newest_after(self, gone: NewMessage) -> int:
        """The newest bucket of ``gone``'s queue and priority, looked up again now
        that ``gone``'s bucket turned out to be missing."""
        self._tails.pop((gone.queue, gone.inverted_priority), None)
        return max(gone.generation, self._find_tail(gone.queue, gone.inverted_priority))

    def _find_uids(self, chunk: list[NewMessage]) -> list[str | None]:
        """The stored names of ``chunk``'s messages in the buckets they were
        published to (None where not found)."""
        found = self._names_by_uid({self.layout.parent(message.path) for message in chunk})
        return [found.get(message.uid) for message in chunk]

    def _find_in_inboxes(self, chunk: list[NewMessage]) -> list[str | None]:
        """The names of ``chunk``'s messages found in their queues' inboxes (a
        listing of ``owned/`` per queue, then one pipelined round of inboxes)."""
        client, layout = self.client, self.layout
        inboxes: list[str] = []
        for queue in {message.queue for message in chunk}:
            try:
                inboxes += [layout.inbox(queue, consumer)
                            for consumer in client.get_children(layout.owned(queue))]
            except NoNodeError:
                continue
        found = self._names_by_uid(inboxes)
        return [found.get(message.uid) for message in chunk]

    def _names_by_uid(self, directories: Iterable[str]) -> dict[str, str]:
        """``{uid: name}`` of the messages in ``directories``, listed in one
        pipelined round (a directory that does not exist holds none)."""
        found: dict[str, str] = {}
        for _, names in listings(self.client, list(directories)):
            for name in names:
                parsed = parse_message_name(name)
                if parsed is not None:
                    found[parsed.uid] = name
        return found

    def _find_tail(self, queue: str, inv: int) -> int:
        """The newest bucket of a priority, made if there is none (or it is full),
        and its twin under ``bodies/``."""
        layout, client = self.layout, self.client
        try:
            names = client.retry(client.get_children, layout.unowned(queue))
        except NoNodeError:
            self.queues.declare(queue)   # first message to an undeclared queue
            names = []
        generations = [parsed[1] for parsed in map(parse_bucket_name, names)
                       if parsed is not None and parsed[0] == inv]
        generation = max(generations, default=0)
        stat = (client.retry(client.exists, layout.bucket(queue, bucket_name(inv, generation)))
                if generations else None)
        if stat is not None and creates(stat) >= self.options.bucket_size:
            generation += 1
            stat = None
        bucket = bucket_name(inv, generation)
        try:
            if stat is None:
                self._create_if_missing(layout.bucket(queue, bucket))
            self._create_if_missing(layout.body_bucket(queue, bucket))
        except NoNodeError:   # the queue was deleted meanwhile: declare it again
            self.queues.declare(queue)
            return self._find_tail(queue, inv)
        self._tails[(queue, inv)] = generation
        self._filled[(queue, inv)] = (generation, creates(stat) if stat is not None else 0)
        return generation

    def _create_if_missing(self, path: str, makepath: bool = False) -> None:
        """Create a directory; NoNode when the queue itself is gone (unless
        ``makepath``: a delayed bucket, whose body's create found the queue)."""
        client = self.client
        try:
            client.retry(client.create, path, makepath=makepath)
        except NodeExistsError:
            pass
