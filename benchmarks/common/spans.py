"""How many of a set of task runs overlapped: what a limit promises, counted
(by ``limits.py``, and by tests/integration/test_limits.py, which imports this
module by path: it has no side effects)."""
from __future__ import annotations


def most_in_any_window(starts: list[float], seconds: float) -> int:
    """The most starts in any window of ``seconds`` (a rate limit's promise)."""
    starts = sorted(starts)
    best = first = 0
    for last, at in enumerate(starts):
        while at - starts[first] >= seconds:
            first += 1
        best = max(best, last - first + 1)
    return best


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most ``(start, end)`` spans running at one instant (a concurrency limit's)."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    now = best = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best
