"""The order an inbox delivers in: the queue's, with handed messages behind
what arrived before them.

An inbox delivers by priority, then the bucket and sequence a name carries,
not in the order things arrived. A handed message's sequence is zero, which
says nothing about when it was published: it sorts right behind the latest
message of its priority this inbox learnt of before it, and handed messages
among themselves in the order they arrived, the order the server committed
them in (for one publisher, the order it published them in; never by their
random uids). See ``docs/design.md``, "Lookahead" and "Hand-off".
"""
from __future__ import annotations

import heapq
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from ..zk.message_names import MessageName

__all__ = ["Claimed", "DeliveryOrder", "Key", "Ready"]


@dataclass(frozen=True)
class Claimed:
    """A message this consumer owns, read and ready to deliver."""

    queue: str
    name: str          # unowned name it had
    owned_path: str    # where it lives while owned (the delivery tag)
    data: bytes
    #: When the read of its body was sent (monotonic): the server answered after.
    read_at: float
    #: When its body was stored (the server's clock, epoch seconds), for its
    #: lifetime (x-message-ttl, expiration); None for one handed over just now.
    stored_at: float | None = None

#: A message's place in an inbox: its queue order (MessageName.sort_key, or for
#: a handed one the place behind what arrived before it), then its arrival.
Key = tuple[tuple[int, int, int, bool, int], int]


class DeliveryOrder:
    """Hands out the :data:`Key` of each message an inbox learns of, in the
    order it learns of them (the order of the watch's events)."""

    def __init__(self) -> None:
        self._latest: dict[int, tuple[int, int, int, bool, int]] = {}   # by priority
        self._arrivals = 0

    def key(self, message: MessageName) -> Key:
        place = message.sort_key
        priority = message.inverted_priority
        latest = self._latest.get(priority)
        if latest is None or place > latest:
            self._latest[priority] = place
        elif message.seq == 0 and not message.requeued and message.generation is not None:
            place = latest   # handed over: behind what arrived before it
        self._arrivals += 1
        return place, self._arrivals


class Ready:
    """Messages read and not delivered yet, by :data:`Key` (a heap)."""

    def __init__(self) -> None:
        self._heap: list[tuple[Key, Claimed]] = []

    def push(self, claimed: Claimed, key: Key) -> None:
        heapq.heappush(self._heap, (key, claimed))

    def pop(self) -> Claimed:
        return heapq.heappop(self._heap)[1]

    def first_key(self) -> Key | None:
        return self._heap[0][0] if self._heap else None

    def latest(self, count: int) -> list[Claimed]:
        """The last ``count`` in delivery order, the last first (what a give-back
        returns first). One selection: found one at a time, a give-back from a
        deep inbox scanned and re-heaped the whole buffer per message."""
        return [claimed for _, claimed in heapq.nlargest(count, self._heap,
                                                         key=lambda entry: entry[0])]

    def remove(self, gone: Collection[Claimed]) -> None:
        """Drop ``gone`` (these very objects), rebuilding the heap once."""
        if not gone:
            return
        ids = {id(claimed) for claimed in gone}
        self._heap[:] = [entry for entry in self._heap if id(entry[1]) not in ids]
        heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Claimed]:
        return (claimed for _, claimed in self._heap)
