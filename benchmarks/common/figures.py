"""The numbers a run prints: log lines, nearest-rank percentiles, samples, rates, tables."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

#: The ratios the reports print: (ours, theirs), each side as the same run
#: measured it (``memory``: Celery alone, the ceiling no broker passes).
PAIRS = (("zk", "redis"), ("zk", "rabbitmq"), ("zk3", "rabbitmq3"), ("zk", "memory"))


def log(msg: str, tag: str = "bench") -> None:
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_info() -> dict[str, Any]:
    """What a run's JSON says of it: the celery_zk it imports (path, commit), the
    machine's cores and load. Before Python 3.11 (no ``PYTHONSAFEPATH``), warns
    when the current directory holds another celery_zk: ``python -m celery``
    workers would import that one."""
    import celery_zk
    used = os.path.dirname(os.path.dirname(os.path.abspath(celery_zk.__file__)))
    cwd = os.getcwd()
    if sys.version_info < (3, 11) and os.path.isfile(
            os.path.join(cwd, "celery_zk", "__init__.py")) and \
            os.path.realpath(cwd) != os.path.realpath(used):
        log(f"WARNING: run from {cwd}, a celery_zk checkout, while importing {used}: the "
            "workers import the current directory's; run from another directory")
    git = subprocess.run(["git", "-C", used, "describe", "--always", "--dirty"],
                         capture_output=True, text=True)
    return {"celery_zk": {"path": used, "commit": git.stdout.strip() or "not a git checkout"},
            "nproc": os.cpu_count(), "loadavg1_at_start": round(os.getloadavg()[0], 2)}


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile (p99 of 200 samples is the 198th smallest)."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))  # ceil
    return ordered[int(rank) - 1]


def table(rows: list[list[str]]) -> list[str]:
    """Aligned columns, a rule under the first row; the first column left-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)


def pause() -> None:
    """20-50 ms between latency samples, so the receiving side is idle each time."""
    time.sleep(random.uniform(0.020, 0.050))


def sample(once: Callable[[], float], samples: int, warm_up: int = 5) -> list[float]:
    """Milliseconds of ``samples`` calls after ``warm_up`` uncounted ones (connections,
    queue declarations), each followed by a pause."""
    for _ in range(warm_up):
        once()
        pause()
    values = []
    for _ in range(samples):
        values.append(once() * 1000)
        pause()
    return values


def threaded_rate(call: Callable[[int], object], total: int, threads: int,
                  then: Callable[[], None]) -> float:
    """Calls per second: ``threads`` threads at once, each calling ``call(index)`` for
    ``index`` in ``range(total // threads)``; the clock runs from the first start until
    every thread has returned and ``then`` has too."""
    per = total // threads

    def run() -> None:
        for index in range(per):
            call(index)

    pool = [threading.Thread(target=run) for _ in range(threads)]
    t0 = time.perf_counter()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    then()
    return per * threads / (time.perf_counter() - t0)
