"""The base of the queue operations: the client, transactions, a queue's directories.

Every state change that touches more than one node is one ``multi``
transaction, so a message is always in exactly one place (unowned, owned or
dead) whatever crashes in between. Operations are retried after
ConnectionLoss; because a lost reply does not say whether a transaction
committed, each retry first checks for the effect it was about to cause.

The operations are split by what they do to a message: :mod:`.publish`
(put), :mod:`.claims` (claim), :mod:`.acks` (ack, requeue, reject);
:class:`~celery_zk.broker.queue.QueueStore` is all of them.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import (
    NodeExistsError,
)
from kazoo.protocol.states import ZnodeStat

from ..zk.client import (
    Deferred,
    multi_failure,
)
from ..zk.config import ZKOptions
from ..zk.layout import Layout
from ..zk.names import parse_bucket_name, parse_message_name

logger = logging.getLogger(__name__)

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

class StoreBase:
    """A kazoo client (through its source), a layout and the options."""

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
