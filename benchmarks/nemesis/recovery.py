"""How long the system took to recover after each heal, read from the history.

Two figures per fault, both from the heal (the partition lifted, the SIGCONT,
the restart spawned):

* ``recover_s``: until the throughput of completed tasks is back: over the
  last :data:`WINDOW` seconds at least :data:`THRESHOLD` of the offered load
  (tasks published per second over the whole run). 0 when it never dropped.
* ``caught_up_s``: until every task published before the heal has completed
  (the backlog the fault built is gone); tasks held back by a countdown are
  left out until they are due.

``None`` when that did not happen: the throughput before the next fault began
(or the publisher stopped), the backlog before the run ended.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

WINDOW = 3.0
THRESHOLD = 0.8
STEP = 0.25


def recover_after(heal: float, limit: float, completions: Sequence[float],
                  offered_rate: float) -> float | None:
    """Seconds from ``heal`` until ``completions`` (sorted times) run at the offered
    rate again, looked for until ``limit``."""
    need = THRESHOLD * offered_rate * WINDOW
    t = heal
    while t <= limit:
        count = bisect.bisect_right(completions, t) - bisect.bisect_right(completions,
                                                                          t - WINDOW)
        if count >= need:
            return round(t - heal, 2)
        t += STEP
    return None


def caught_up_after(heal: float, limit: float,
                    due_and_done: Sequence[tuple[float, float | None]]) -> float | None:
    """Seconds from ``heal`` until every task due before it (``(due, first
    completion or None)`` pairs, sorted by due) completed; looked for until ``limit``."""
    last = heal
    end = bisect.bisect_right(due_and_done, (heal, float("inf")))
    for _, done in due_and_done[:end]:
        if done is None or done > limit:
            return None
        last = max(last, done)
    return round(last - heal, 2)


def measure(faults: list[dict[str, Any]], publishing_end: float, run_end: float,
            completions: Sequence[float], due_and_done: Sequence[tuple[float, float | None]],
            offered_rate: float) -> None:
    """Add ``recover_s`` and ``caught_up_s`` to each fault (sorted by start). The
    throughput is looked at until the next fault, while the publisher ran; the
    backlog until the run's end."""
    for i, fault in enumerate(faults):
        limit = faults[i + 1]["started"] if i + 1 < len(faults) else run_end
        heal = fault["healed"] or fault["started"]
        fault["recover_s"] = recover_after(heal, min(limit, publishing_end), completions,
                                           offered_rate)
        # Until the run's end: what a killed worker held comes back only when its
        # session expires, which may be after the next fault began.
        fault["caught_up_s"] = caught_up_after(heal, run_end, due_and_done)
