"""How much a consumer's inbox may hold (its *credit*: the prefetch, or
``lookahead`` times it while the consumer runs dry fast), and what goes back
to the queue while the channel takes none (the *hold*).

The hold is judged by the pace of the last deliveries, not by the prefetch
being full at one moment: a prefork worker draining quick tasks is full
between deliveries, and must not give its inbox back. See
``docs/design.md``, "Lookahead".
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

__all__ = ["Credit", "held_back"]

#: A consumer that delivered its prefetch's worth within this many seconds and
#: then ran dry waits for refills: its inbox may hold the ``lookahead`` option
#: times its prefetch.
FAST = 0.1
#: Seconds without a delivery after which the lookahead ends.
IDLE = 1.0
#: Seconds undelivered messages may wait in the inbox while the channel takes
#: none (its prefetch is full: a long task) before they go back to the queue.
HOLD = 1.0
#: Seconds between two looks of a full channel at what waits in its inbox:
#: asked after every delivery that fills the channel (each task of a busy
#: prefork worker), judged this often; HOLD is what counts.
HOLD_LOOK = 0.01


def held_back(waiting: int, took: Sequence[float], now: float) -> int:
    """How many of ``waiting`` messages the pace of the deliveries made at
    ``took`` (the last prefetch's worth) would not deliver within HOLD s."""
    if not waiting:
        return 0
    if not took:
        return waiting
    return max(0, waiting - int(len(took) * HOLD / max(now - took[0], 1e-6)))


class Credit:
    """One inbox's credit: its prefetch, the lookahead, the hold."""

    def __init__(self, lookahead: int) -> None:
        self.lookahead = lookahead
        self.prefetch = 0                     # the channels' prefetch (0: unlimited)
        self.deep = False                     # lookahead on: lookahead x prefetch
        self.took: deque[float] = deque()     # when the last `prefetch` deliveries were
        self.held_since: float | None = None  # the inbox fell behind its pace
        self._hold_look_at = 0.0              # when the hold looks again

    @property
    def value(self) -> int:
        """What the consumer's node says it may hold."""
        return self.prefetch * (self.lookahead if self.deep else 1)

    def set_prefetch(self, prefetch: int) -> None:
        if prefetch != self.prefetch:
            self.prefetch = prefetch
            self.took = deque(self.took, maxlen=prefetch or 1)

    def delivered(self) -> None:
        self.took.append(time.monotonic())

    def taking(self) -> None:
        """The channel takes messages again: no hold."""
        self.held_since = None

    def dry(self) -> None:
        """Nothing to deliver while the channel could take more: a consumer that
        delivered its prefetch within FAST s waits for refills (lookahead on);
        one idle for IDLE s needs no lookahead."""
        now = time.monotonic()
        took = self.took
        if not self.deep:
            self.deep = bool(self.prefetch and self.lookahead > 1 and len(took) == self.prefetch
                             and now - took[0] <= FAST)
        elif not took or now - took[-1] > IDLE:
            self.deep = False

    def hold_due(self) -> bool:
        """Whether the hold looks now (the channel takes nothing)."""
        now = time.monotonic()
        if now < self._hold_look_at:
            return False
        self._hold_look_at = now + HOLD_LOOK
        return True

    def excess(self, waiting: int) -> int:
        """How many of the ``waiting`` messages go back now: those the pace would
        not deliver within HOLD s, once that has lasted HOLD s (the lookahead
        ends then too); 0 otherwise."""
        now = time.monotonic()
        excess = held_back(waiting, self.took, now)
        if not excess:
            self.held_since = None
            return 0
        if self.held_since is None:
            self.held_since = now
            return 0
        if now - self.held_since <= HOLD:
            return 0
        self.held_since = None
        self.deep = False
        return excess
