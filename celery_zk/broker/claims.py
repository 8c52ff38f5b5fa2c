"""Claiming: waiting messages moved into this consumer's name in one multi,
sent pipelined, read ahead, and settled when a reply was lost."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kazoo.exceptions import (
    BadVersionError,
    ConnectionLoss,
    NodeExistsError,
    NoNodeError,
)

from ..zk.client import (
    multi_failure,
    reply_or_retry,
)
from ..zk.layout import (
    owned_name,
)
from .store import OP_OVERHEAD, StoreBase

logger = logging.getLogger(__name__)

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

class Claiming(StoreBase):
    """claim, claim_async: the consuming side of :class:`QueueStore`."""

    def read_async(self, queue: str, name: str) -> Any:
        """Start reading a waiting message (pipelined; not from a tree-watch callback,
        which runs on kazoo's connection thread: see celery_zk.broker.queue_view)."""
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
