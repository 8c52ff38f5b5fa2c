"""Giving waiting messages to consumers: names moved from ``unowned/`` into
inboxes, many messages for many consumers in one multi.

The dispatcher (:mod:`celery_zk.broker.dispatcher`) is the one writer of
assignments; a consumer claims for itself only for ``basic_get``. Each
consumer's part of a multi is guarded by a check of its node under the
queue's ``consumers/``, so nothing is ever given to a consumer that is gone
or has stopped consuming; each name is moved by deleting it from its bucket
in the same multi that creates it in the inbox, so a message is given once
even when two dispatchers overlap (the second one's delete fails).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kazoo.client import TransactionRequest
from kazoo.exceptions import (
    BadVersionError,
    ConnectionLoss,
    NodeExistsError,
    NoNodeError,
)

from ..zk.client import multi_failure, synced
from .store import ANY_VERSION, OP_OVERHEAD, REQUEST_BUDGET, StoreBase

logger = logging.getLogger(__name__)

#: Most operations in one assignment multi (each a path of ~150 bytes at most:
#: far below jute.maxbuffer).
ASSIGN_OPS = 1000


@dataclass
class ClaimCounts:
    """What this process's assignments cost (for benchmarks and monitoring)."""

    transactions: int = 0   # assignment and claim multis sent
    conflicts: int = 0      # of those, refused (a consumer or a message gone meanwhile)
    messages: int = 0       # messages given (hand-offs not counted)


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
    #: When the read of its body was sent (monotonic): the server answered after.
    read_at: float


@dataclass
class Assignment:
    """One multi's worth of names for consumers, as built by :meth:`Claiming.assignment`."""

    queue: str
    ops: list[tuple[str, str, str]] = field(default_factory=list)   # (kind, consumer, name)
    size: int = 0

    def given(self) -> dict[str, list[str]]:
        """Consumer id -> the names given to it."""
        given: dict[str, list[str]] = {}
        for kind, consumer, name in self.ops:
            if kind == "create":
                given.setdefault(consumer, []).append(name)
        return given


class Claiming(StoreBase):
    """Moving names into inboxes: the dispatcher's multis, ``basic_get``'s claim."""

    def assignment(self, queue: str, plan: dict[str, list[str]],
                   nodes: dict[str, str]) -> tuple[TransactionRequest, Assignment]:
        """The multi that gives each consumer of ``plan`` its names; ``nodes``:
        each one's node under the queue's consumers/, which the multi checks.
        Stops adding consumers before :data:`ASSIGN_OPS` operations or
        :data:`REQUEST_BUDGET` bytes.
        """
        layout = self.layout
        txn = self.client.transaction()
        done = Assignment(queue)
        budget = REQUEST_BUDGET
        for consumer, names in plan.items():
            ops = 1 + 2 * len(names)
            size = sum(2 * len(name) + OP_OVERHEAD for name in names)
            if done.ops and (len(done.ops) + ops > ASSIGN_OPS or done.size + size > budget):
                break
            txn.check(layout.queue_consumer(queue, nodes[consumer]), ANY_VERSION)
            done.ops.append(("check", consumer, ""))
            for name in names:
                # Without the multi a crash between the two would lose the
                # message (deleted, never given) or give it twice.
                txn.delete(layout.unowned_message(queue, name))
                txn.create(layout.inbox_message(queue, consumer, name))
                done.ops += [("delete", consumer, name), ("create", consumer, name)]
            done.size += size
        CLAIMS.transactions += 1
        return txn, done

    def settle(self, done: Assignment, results: list[Any]) -> tuple[str, str, str] | None:
        """None when the assignment committed, else the operation that refused it
        (``(kind, consumer, name)``): its consumer or message is gone."""
        failure = multi_failure(results)
        if failure is None:
            CLAIMS.messages += sum(1 for kind, _, _ in done.ops if kind == "create")
            return None
        index, error = failure
        if not isinstance(error, (NoNodeError, NodeExistsError, BadVersionError)):
            raise error
        CLAIMS.conflicts += 1
        return done.ops[index]

    def claim_one(self, queue: str, name: str, consumer_id: str) -> str | None:
        """Move one waiting message into our own inbox (``basic_get``); its owned
        path, or None when another consumer (or the dispatcher) took it first."""
        client = self.client
        txn = client.transaction()
        owned = self.layout.inbox_message(queue, consumer_id, name)
        txn.delete(self.layout.unowned_message(queue, name))
        txn.create(owned)
        CLAIMS.transactions += 1
        try:
            results = txn.commit()
        except ConnectionLoss:
            # Did it commit? The create tells (the multi is all or nothing).
            synced(client, owned)
            return owned if client.retry(client.exists, owned) is not None else None
        failure = multi_failure(results)
        if failure is None:
            CLAIMS.messages += 1
            return owned
        if isinstance(failure[1], (NoNodeError, BadVersionError, NodeExistsError)):
            CLAIMS.conflicts += 1
            return None
        raise failure[1]

    def read_owned(self, owned_path: str) -> tuple[bytes, Any]:
        client = self.client
        return client.retry(client.get, owned_path)

