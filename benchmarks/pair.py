"""Two checkouts of celery_zk draining at the same time: which costs less per task.

The paired A/B behind docs/performance.md's ledger of mechanisms. On a shared
VM one drain's rate moves by ±15 % between runs minutes apart, and the
machine, not the change, decides an A/B of runs taken one after the other.
Here both checkouts drain together, on one ZooKeeper, each its own queue of
``--tasks`` stored no-op tasks and its own worker (``--pool``, ``-c``): a
slower or faster host slows or speeds both alike. Each pair reports the two
rates over the window both ran in (from the later first task to the first
drain's end), each worker process's CPU per task over it and its pool
children's (a threads pool has none: the worker's CPU is the figure), and
B's ÷ A's; ``--pairs`` pairs, which checkout's worker is
started first alternating. Both workers share two cores, so each drains at
about half its rate alone, and which one the scheduler favours moves the
rates by ±10 % (the same checkout against itself: 0.81-1.20 over two runs
of six pairs): the worker
process's CPU per task, which both measure on the same host at the same
time, is the figure to compare; over its children's CPU (the tasks' own
work, the same code in both), it varied by ±2-3 % (a against itself:
0.98-1.04 over six pairs; 0.94-1.07 not so divided).

Usage (run from a directory that is no repository; both checkouts must store
messages as this one does, which preloads them)::

    .venv/bin/python benchmarks/pair.py --a /tmp/wt-a --b /tmp/wt-b \\
        [--pool prefork] [-c 4] [--tasks 10000] [--pairs 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from typing import Any

from common.app import preload
from common.figures import log, write_json
from common.machine import cpu_seconds, run_pids
from common.processes import BENCHMARKS, Processes, bench_run
from common.servers import add_server_options, start_server
from common.tally import Tally
from common.worker import await_ready, spawn_worker

POLL = 0.05   # seconds between looks at the two tallies and the workers' CPU


def at(points: list[tuple[float, ...]], t: float, column: int) -> float:
    """``column`` of the polls, interpolated at time ``t`` (column 0)."""
    before = [p for p in points if p[0] <= t]
    after = [p for p in points if p[0] >= t]
    if not before or not after:
        return float((before[-1] if before else points[0])[column])
    p0, p1 = before[-1], after[0]
    if p1[0] == p0[0]:
        return float(p0[column])
    return p0[column] + (p1[column] - p0[column]) * (t - p0[0]) / (p1[0] - p0[0])


def one_pair(url: str, work_dir: str, checkouts: list[tuple[str, str]], args: argparse.Namespace,
             index: int) -> dict[str, Any]:
    procs = Processes()
    gate = os.path.join(work_dir, f"pair{index}.gate")
    tallies: dict[str, Tally] = {}
    workers = {}
    try:
        for label, path in checkouts:
            queue = f"pair-{label}-{uuid.uuid4().hex[:6]}"
            preload(url, queue, args.tasks)
            tallies[label] = Tally(os.path.join(work_dir, f"pair{index}-{label}.tally"),
                                   args.tasks)
            env = {"PYTHONPATH": os.pathsep.join([BENCHMARKS, path]),
                   "BENCH_TALLY_FILE": tallies[label].path, "BENCH_GATE_FILE": gate}
            workers[label] = spawn_worker(procs, work_dir, f"pair{index}-{label}", url, queue,
                                          pool=args.pool, concurrency=args.concurrency,
                                          wait=False, env=env)
        await_ready(work_dir, list(workers.values()), [f"pair{index}-{label}" for label in workers])
        time.sleep(1.0)   # both idle, both consuming
        # Each worker's process and its pool's children (its process group).
        parents = {label: proc.pid for label, proc in workers.items()}
        children = {label: [child for child in run_pids([parent], []) if child != parent]
                    for label, parent in parents.items()}
        # (time, tasks run, parent CPU s, children CPU s) per worker
        points: dict[str, list[tuple[float, ...]]] = {label: [] for label in tallies}
        open(gate, "w").close()
        ends: dict[str, float] = {}
        deadline = time.monotonic() + max(300.0, args.tasks / 20)
        while len(ends) < len(tallies):
            now = time.monotonic()
            for label, tally in tallies.items():
                points[label].append((now, tally.executions(), cpu_seconds([parents[label]]),
                                      cpu_seconds(children[label])))
                if label not in ends and tally.done():
                    ends[label] = now
            if now > deadline:
                raise RuntimeError("the drains did not finish")
            time.sleep(POLL)
        firsts = {label: tally.summary().first for label, tally in tallies.items()}
        start, end = max(firsts.values()), min(ends.values())
        # The first tenth of the common window is start-up (the first listing, the pools).
        start += (end - start) * 0.1
        figures: dict[str, dict[str, float]] = {}
        for label, polls in points.items():
            tasks = at(polls, end, 1) - at(polls, start, 1)
            figures[label] = {
                "rate": tasks / (end - start),
                "parent_us": (at(polls, end, 2) - at(polls, start, 2)) * 1e6 / tasks,
                "children_us": (at(polls, end, 3) - at(polls, start, 3)) * 1e6 / tasks}
    finally:
        procs.stop_all()
        for tally in tallies.values():
            tally.close()
    a, b = figures["a"], figures["b"]
    # A pool without child processes (threads, solo) runs the tasks in the
    # worker process: nothing to divide by, the worker's CPU is the figure.
    children = bool(a["children_us"] and b["children_us"])
    out: dict[str, Any] = {"first": checkouts[0][0], "window_s": end - start, **figures,
                           "b_over_a": b["rate"] / a["rate"],
                           "parent_b_over_a": b["parent_us"] / a["parent_us"],
                           "relative_b_over_a": (b["parent_us"] / b["children_us"])
                           / (a["parent_us"] / a["children_us"]) if children else None}
    log(f"pair {index + 1}: tasks/s a {a['rate']:,.0f} b {b['rate']:,.0f} (b ÷ a "
        f"{out['b_over_a']:.3f}); worker process µs per task a {a['parent_us']:.0f} b "
        f"{b['parent_us']:.0f} (b ÷ a {out['parent_b_over_a']:.3f})"
        + (f"; children a {a['children_us']:.0f} b {b['children_us']:.0f} (worker ÷ "
           f"children, b ÷ a {out['relative_b_over_a']:.3f})" if children else "")
        + f"; over {end - start:.1f} s, {checkouts[0][0]} started first")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", required=True, help="checkout A (a directory holding celery_zk/)")
    parser.add_argument("--b", required=True, help="checkout B")
    parser.add_argument("--pool", default="prefork")
    parser.add_argument("-c", "--concurrency", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=10000, help="tasks per drain")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--json", help="write the pairs' figures here")
    add_server_options(parser)
    args = parser.parse_args(argv)
    for path in (args.a, args.b):
        if not os.path.isfile(os.path.join(path, "celery_zk", "__init__.py")):
            parser.error(f"{path} holds no celery_zk/: give a checkout's top directory")
    pairs = []
    with bench_run("celery_zk-pair-") as (procs, work_dir, stops):
        url = start_server("zk", args, procs, work_dir, stops, "pair").url
        for index in range(args.pairs):
            order = [("a", args.a), ("b", args.b)]
            pairs.append(one_pair(url, work_dir, order if index % 2 == 0 else order[::-1],
                                  args, index))
    for key, what in (("b_over_a", "tasks/s"), ("parent_b_over_a", "parent CPU per task"),
                      ("relative_b_over_a", "parent CPU ÷ children CPU")):
        ratios = [p[key] for p in pairs if p[key] is not None]
        if not ratios:
            continue
        log(f"b ÷ a, {what}, over {len(pairs)} pairs: median {statistics.median(ratios):.3f}, "
            f"mean {statistics.mean(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}")
    if args.json:
        write_json(args.json, {"a": args.a, "b": args.b, "pool": args.pool,
                               "concurrency": args.concurrency, "tasks": args.tasks,
                               "pairs": pairs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
