"""Per-thread CPU of ``celery worker`` parents, per task (issue 26).

Usage::

    mkdir -p /tmp/tc && BENCH_THREAD_CPU_DIR=/tmp/tc \\
        PYTHONPATH=benchmarks/thread_cpu:$PWD .venv/bin/python benchmarks/workers.py \\
        --brokers zk,rabbitmq --only single --pools prefork --single-tasks 10000
    .venv/bin/python benchmarks/thread_cpu.py /tmp/tc

(run from a directory that is no repository, with ``$PWD`` the checkout, as
for ``workers.py``). Each worker parent's samples (``thread_cpu/sitecustomize.py``)
give, between its 10% and 90% of tasks received: the parent's CPU per task,
each of its threads' and how often each went to sleep (a thread waiting for
the GIL, a lock or a reply; a process of one busy thread never waits for the
GIL), its pool's children's CPU (the task's own work, the same for every
broker: a yardstick for how busy the machine was), the parent's CPU over
the children's, and how many cores the parent used.
"""
from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any


def report(path: str) -> str | None:
    with open(path) as f:
        data = json.load(f)
    samples: list[Any] = [s for s in data["samples"] if s[3]]
    total = samples[-1][2] if samples else 0
    if total < 1000:
        return None
    low = next(s for s in samples if s[2] >= total * 0.1)
    high = next(s for s in samples if s[2] >= total * 0.9)
    tasks, seconds = high[2] - low[2], high[0] - low[0]
    if not tasks or seconds <= 0:
        return None
    parent = (high[1] - low[1]) * 1e6 / tasks
    each = {name: (high[3].get(name, 0.0) - low[3].get(name, 0.0)) * 1e6 / tasks
            for name in high[3]}
    children = each.pop("(children)", 0.0)
    threads = ", ".join(f"{name} {us:.0f}" for name, us in
                        sorted(each.items(), key=lambda item: -item[1]) if us >= 5)
    # Sleeps per task (voluntary context switches; samples of older probes lack them)
    before, after = (low[4] if len(low) > 4 else {}), (high[4] if len(high) > 4 else {})
    sleeps = {name: (after[name] - before.get(name, 0)) / tasks for name in after}
    if sleeps:
        threads += "\n    sleeps per task: " + ", ".join(
            f"{name} {n:.2f}" for name, n in sorted(sleeps.items(), key=lambda i: -i[1])
            if n >= 0.01) + f" (all threads {sum(sleeps.values()):.2f})"
    return (f"{os.path.basename(path)} -P {data['pool']}: {tasks / seconds:,.0f} tasks/s; "
            f"parent {parent:.0f} us CPU per task ({(high[1] - low[1]) / seconds:.2f} "
            f"cores), children {children:.0f} us, parent/children "
            f"{parent / children if children else float('nan'):.2f}\n    {threads}")


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else "."
    for path in sorted(glob.glob(os.path.join(folder, "*.json")), key=os.path.getmtime):
        line = report(path)
        if line:
            print(line)


if __name__ == "__main__":
    main()
