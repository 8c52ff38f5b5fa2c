"""Which waiting messages a consumer takes when their names carry affinity
keys (:mod:`celery_zk.features.affinity`): delay scheduling, from the names of
the listing alone.

Among the first :data:`WINDOW` waiting messages of the best priority: first
the oldest once it has been the oldest for ``locality_wait`` seconds (so none
waits forever), then those whose key the consumer's worker holds or without
a key, and only when there are none the messages of *one* key nobody holds,
or that another worker holds and this consumer saw wait ``locality_wait``.
A lower priority is never taken while a better one waits. See
``docs/features.md``, "Data-affinity scheduling".
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice
from time import monotonic
from typing import Protocol

from ..zk.message_names import quick_affinity, sort_messages
from .affinity import Where

__all__ = ["MIN_STARTED", "WINDOW", "Holders", "Waiting", "choose"]

#: How many waiting messages of the best priority a consumer chooses among.
WINDOW = 1024
#: Least seconds a key this consumer started on counts as its own (see choose).
MIN_STARTED = 1.0


class Holders(Protocol):
    """Where a key is held (:class:`celery_zk.features.affinity.Board`)."""

    def where(self, token: str) -> Where: ...


@dataclass
class Waiting:
    """What one consumer remembers between choices (see :func:`choose`)."""

    #: Keyed messages this consumer may not take yet: when it first saw each.
    seen: dict[str, float] = field(default_factory=dict)
    #: Keys it started on without holding them: when.
    started: dict[str, float] = field(default_factory=dict)
    #: The oldest waiting message, and since when it has been the oldest.
    head: str | None = None
    head_since: float = 0.0

    def forget(self, listed: set[str]) -> None:
        """Drop what it remembers of messages that are gone."""
        self.seen = {name: at for name, at in self.seen.items() if name in listed}


def _oldest(names: Iterable[str], among: int) -> str | None:
    """The first message in delivery order among the first ``among`` names
    (sorted again: a caller's names need not be strictly in order at their front)."""
    ours = sort_messages(list(islice(names, among)))[0]
    return ours[0] if ours else None


def choose(names: Iterable[str], limit: int, board: Holders, waiting: Waiting, wait: float,
           index: int = 0, idle: bool = True) -> tuple[list[str], float | None]:
    """Up to ``limit`` of ``names`` (a sorted listing) to claim, and, when none
    can be taken yet, the seconds until one can.

    ``waiting``: what this consumer remembers across calls. ``index``: its
    place among the live ones, so consumers without local work start on
    different keys. ``idle``: it has nothing claimed or running.
    """
    now = monotonic()
    started, seen = waiting.started, waiting.seen
    recent = max(wait, MIN_STARTED)
    # Started keys bridge the time until the task says it holds the key (from
    # then on the holdings decide, evictions included), or until they expire.
    for key in [key for key, at in started.items()
                if now - at > recent or board.where(key) is Where.MINE]:
        del started[key]
    batch: list[str] = []   # held here (or just started on), or without a key
    free: dict[str, list[str]] = {}   # key -> its messages nobody here may wait for
    best: str | None = None
    soonest: float | None = None

    def due_at(at: float) -> None:
        nonlocal soonest
        if soonest is None or at < soonest:
            soonest = at

    head = _oldest(names, 2 * limit + 1)
    if head is not None:
        if waiting.head != head:
            waiting.head, waiting.head_since = head, now
        if now - waiting.head_since >= wait:
            # The oldest message has been the oldest for the whole wait: whoever
            # looks takes it first, whatever its key. Every message becomes the
            # oldest in its turn, so none waits forever behind others' local work.
            batch.append(head)
            token = quick_affinity(head)
            if (token is not None and token not in started
                    and board.where(token) is Where.NOWHERE):
                started[token] = now   # this consumer loads it now
        else:
            due_at(waiting.head_since + wait)
    head_taken = bool(batch)
    for name in islice(names, WINDOW):
        if len(batch) >= limit:
            break
        priority = name[1]   # "m{P}-…": one digit, inverted (see layout)
        if best is None:
            best = priority
        elif priority != best:
            break   # priority wins over affinity
        if head_taken and name == head:
            continue   # taken above
        token = quick_affinity(name)
        if token is None or token in started:
            batch.append(name)
            continue
        where = board.where(token)
        if where is Where.MINE:
            batch.append(name)
        elif where is Where.NOWHERE:
            free.setdefault(token, []).append(name)
        else:
            due = seen.setdefault(name, now) + wait
            if due <= now:
                free.setdefault(token, []).append(name)
            else:
                due_at(due)
    if batch:
        return batch, None
    # A key started on and not yet said to be held is being loaded: start no
    # second one meanwhile (a prefetch window would fill with new keys before
    # any is loaded), unless nothing runs (tasks that never call hold()).
    if free:
        if idle or not started:
            # No local work: start on one new key (its data is loaded once), a
            # different one for each consumer, rather than on many at once. Until
            # its task says it holds it, the key counts as this consumer's.
            keys = list(free)
            chosen = keys[index % len(keys)]
            started[chosen] = now
            return free[chosen][:limit], None
        for at in started.values():   # look again when a started key lapses
            due_at(at + recent)
    return [], None if soonest is None else max(0.0, soonest - now)
