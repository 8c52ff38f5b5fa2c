"""Plain-text reports for the terminal: ``celery zk status`` and ``dead list``."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from .dead_letters import DeadLetter
from .limits import LimitStatus
from .status import BudgetStatus, Status

__all__ = ["format_dead", "format_limits", "format_status"]


def age(seconds: float | None) -> str:
    """``3m12s``-style; ``-`` when there is nothing to age."""
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip()
             for line in [header, *rows]]
    return "\n".join(lines)


def format_budget(budget: BudgetStatus, now: float) -> str:
    def share(held: int | None, limit: int, show: Callable[[int], str]) -> str:
        text = "?" if held is None else show(held)
        return f"{text} of {show(limit)}" if limit else f"{text} (no limit)"
    if budget.nodes is None:
        line = ("storage budget: not counted (the root has no quota yet: a publisher "
                "makes it, or see docs/operations.md)")
    else:
        line = (f"storage budget: {share(budget.nodes, budget.max_nodes, '{:,} znodes'.format)}"
                f", {share(budget.bytes, budget.max_bytes, _size)}")
    if budget.blocked:
        since = budget.blocked_since or now
        queues = sorted({str(b.get("queue")) for b in budget.blocked})
        line += (f"; FULL: {len(budget.blocked)} publisher process(es) blocked for "
                 f"{age(now - since)} (queues {', '.join(queues)})")
    else:
        line += "; no publisher blocked"
    return line


def format_status(status: Status, url: str) -> str:
    now = time.time()
    parts = [f"celery_zk status of {url}  (read in {status.took:.2f} s)", ""]
    if status.queues:
        rows = []
        for queue in status.queues:
            priorities = " ".join(f"{p}:{n:,}" for p, n in sorted(queue.waiting.items(),
                                                                   reverse=True))
            chunked = (f"{queue.chunked:,} ({_size(queue.chunked_bytes)})" if queue.chunked
                       else "-")
            limits = " ".join(f"{k.removeprefix('x-')}={v}"
                              for k, v in sorted(queue.arguments.items())) or "-"
            delayed = "-"
            if queue.delayed:
                due_in = max(0.0, (queue.next_due or now) - now)
                delayed = f"{queue.delayed:,} (next in {age(due_in)})"
            rows.append([queue.name, f"{queue.waiting_total:,}", priorities or "-", delayed,
                         f"{queue.owned_total:,}", f"{queue.dead:,}", str(queue.offers),
                         age(queue.oldest_age), chunked, limits,
                         f"{queue.expired:,}/{queue.dropped:,}"])
        parts.append(table(["QUEUE", "WAITING", "BY PRIORITY", "DELAYED", "OWNED", "DEAD", "IDLE",
                            "OLDEST", "CHUNKED", "LIMITS", "EXPIRED/DROPPED"], rows))
    else:
        parts.append("no queues")
    parts.append("")
    if status.consumers:
        rows = [[c.id, c.host, str(c.pid or "-"), ",".join(c.queues) or "-", f"{c.owned:,}",
                 age(now - c.since)] for c in status.consumers]
        parts.append(table(["CONSUMER", "HOST", "PID", "QUEUES", "OWNED", "UP"], rows))
    else:
        parts.append("no consumers")
    if status.budget is not None:
        parts += ["", format_budget(status.budget, now)]
    if status.limits:
        parts += ["", format_limits(status.limits)]
    if status.results is not None:
        r = status.results
        parts += ["", f"results under {r.root}: {r.results:,} results, {r.groups:,} groups, "
                      f"{r.chords:,} chords; {r.expired:,} past result_expires; "
                      f"{r.chunked:,} stored in chunks ({_size(r.chunked_bytes)}); "
                      + (f"expired ones last deleted {age(now - r.cleaned_at)} ago"
                         if r.cleaned_at is not None else "expired ones never deleted yet")]
    if status.servers:
        parts.append("")
        rows = []
        for server, health in sorted(status.servers.items()):
            if "error" in health:
                rows.append([server, "DOWN", health["error"], "", "", "", ""])
                continue
            rows.append([server, str(health.get("zk_server_state", "?")),
                         f"{_ms(health.get('zk_avg_latency'))}/{_ms(health.get('zk_max_latency'))}",
                         str(health.get("zk_outstanding_requests", "?")),
                         _number(health.get("zk_znode_count")),
                         _number(health.get("zk_watch_count")),
                         _size(health.get("zk_approximate_data_size"))])
        parts.append(table(["SERVER", "STATE", "LATENCY AVG/MAX ms", "OUTSTANDING", "ZNODES",
                            "WATCHES", "DATA"], rows))
        notes = {h["note"] for h in status.servers.values() if "note" in h}
        parts += sorted(notes)
    return "\n".join(parts)


def _ms(value: object) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".") if isinstance(value, (int, float)) else "?"


def _number(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) else "?"


def _size(value: object) -> str:
    if not isinstance(value, int):
        return "?"
    size = float(value)
    for unit in ("B", "KB", "MB"):
        if size < 1024:
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{size:,.1f} GB"


def format_limits(limits: list[LimitStatus]) -> str:
    """The cluster-wide limits: each one, its use now, what waits on it."""
    rows = []
    for limit in limits:
        rate = (f"{limit.given_in_window}/{limit.rate.partition('/')[0]} per "
                f"{limit.rate.partition('/')[2] or 's'}" if limit.rate else "-")
        running = (f"{limit.in_flight}/{limit.concurrency}"
                   + (f" per {limit.key}" if limit.key else "")
                   if limit.concurrency else "-")
        rows.append([limit.kind, limit.name, rate, running, f"{limit.waiting:,}"])
    return table(["LIMIT ON", "NAME", "RATE (GIVEN/LIMIT)", "RUNNING/LIMIT", "WAITING"], rows)


def format_dead(queue: str, letters: list[DeadLetter]) -> str:
    if not letters:
        return f"queue {queue!r} has no dead letters"
    now = time.time()
    rows = [[letter.id, age(now - letter.at) if letter.at else "?",
             letter.task or "-", letter.task_id or "-", letter.reason] for letter in letters]
    return (table(["ID", "AGE", "TASK", "TASK ID", "REASON"], rows)
            + f"\n{len(letters)} dead letter(s) in queue {queue!r}")
