"""Delayed tasks (``countdown``/``eta``), side by side on zk, Redis and RabbitMQ.

Each broker in turn, only its server running (as ``workers.py``); real ``celery
worker -P threads -c 4`` processes running :mod:`common.app`; tasks published
with Celery's public API only (``apply_async(countdown=...)`` / ``eta=``). Celery
hands a delayed task to a worker at once and the worker holds it until due
(raising its prefetch by one per held task); a broker that keeps it until due
changes what these figures show, not how they are taken.

(held)    ``--held`` (20,000) tasks with countdown=3600 published (4 threads:
          publish/s), then one worker; once it has *fetched* (the queue empty and
          the worker's RSS unchanged for 3 s, or the queue's count and the RSS
          unchanged for 15 s: a broker that keeps delayed messages keeps its
          count; at most ``--fetch-limit``), 200 no-op tasks due now: seconds from
          the first publish until all 200 ran (:mod:`common.tally`; at most
          ``--due-limit``), the worker's RSS (its process tree) once ready, once
          fetched and at the end.
(spread)  ``--spread-tasks`` (100,000) ``bench.late`` tasks, each eta the start of
          publishing plus uniform(0, ``--span`` (600 s)), all published first (as
          fast as 4 threads go), then ``--workers`` (1) worker(s) run them as they
          come due. Each task logs its start minus its eta. Lateness p50/p99/max
          counts the tasks due after the workers were ready (those due while
          publishing or starting are counted apart; those due in the first
          ``CATCH_UP`` s wait behind them), *steady* those due after that; then
          how many ran, more than once, not at all; the workers' peak RSS and
          CPU seconds since ready.
(backlog) a drain of ``--drain`` (10,000) no-op tasks published at once (4 threads)
          to a running worker: first on an empty queue, then onto ``--backlog``
          (100,000) tasks with countdown=86400 that the worker has fetched, after
          ``--idle`` (60) s of it idle: RSS, CPU seconds and, for zk, the
          server's ``zk_packets_received`` (``mntr``) over the idle window. A
          drain's rate runs from its first task's start to its last's (the
          publishing goes on meanwhile), its seconds from the first publish.

Usage::

    .venv/bin/python benchmarks/delayed.py [--quick] [--brokers zk,redis,rabbitmq]
        [--only held,spread,backlog] [--held 20000] [--spread-tasks 100000] [--span 600]
        [--workers 1] [--backlog 100000] [--idle 60] [--drain 10000]
        [--zk-option KEY=VALUE] [--json out.json]

``--quick``: 1,000 held, 2,000 spread over 30 s, a 5,000 backlog idle 10 s,
2,000-task drains, 30 s limits: checks the parts, measures little (about 6 min).
A table's ``late`` is a limit reached: on RabbitMQ a worker holding only
far-off etas fetches a few messages a second (Celery raises the prefetch by
those it got, once per turn of its event loop, which sleeps up to 10 s), so
the due tasks and the drain wait behind the held ones (``waiting in queue``).
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import kombu.pools
from common.app import LATE, NOOP, TALLY, make_app, waiting
from common.figures import log, percentile, run_info, table, write_json
from common.machine import cpu_seconds, quiet_check, run_pids
from common.processes import Processes, bench_run
from common.servers import Server, add_server_options, choose, start_server
from common.tally import Tally
from common.worker import await_ready, spawn_worker

BROKERS = ("zk", "redis", "rabbitmq")
PARTS = ("held", "spread", "backlog")
DUE = 200            # held: the tasks due now, published behind the held ones
PUBLISHERS = 4       # threads publishing a batch
#: spread: seconds after the workers were ready from which a task's lateness counts
#: as steady (the tasks due while publishing have run by then)
CATCH_UP = 120.0
STABLE = 3.0         # fetched: an empty queue and the workers' RSS unchanged this long (s)
STILL = 15.0         # or a queue not empty unchanged this long: longer than the 10 s a
                     # worker's event loop may sleep between fetches (kombu's hub)
Message = Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]]


def publish(url: str, queue: str, name: str, total: int, message: Message) -> tuple[float, float]:
    """``total`` tasks ``name``, task ``i`` applied as ``message(i)`` (args, options),
    from :data:`PUBLISHERS` threads; (monotonic start, seconds until the broker has all)."""
    app = make_app(url)
    task = app.tasks[name]

    def run(first: int) -> None:
        for index in range(first, total, PUBLISHERS):
            args, options = message(index)
            task.apply_async(args, queue=queue, **options)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(PUBLISHERS)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    app.close()
    kombu.pools.reset()   # a connection closes once what it published is stored
    return start, time.monotonic() - start


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status", encoding="ascii") as fh:
                total += next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return round(total / 1024, 1)


def tree(workers: list[subprocess.Popen[bytes]]) -> list[int]:
    """The workers' processes: each main process and its pool children (its group)."""
    return run_pids([w.pid for w in workers], [w.pid for w in workers])


def await_tally(tally: Tally, workers: list[subprocess.Popen[bytes]], label: str,
                timeout: float) -> bool:
    """Whether every task of ``tally`` ran within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not tally.done():
        if any(w.poll() is not None for w in workers):
            raise RuntimeError(f"{label}: a worker exited")
        if time.monotonic() > deadline:
            log(f"WARNING: {label}: {tally.summary().distinct if tally.started() else 0} "
                f"of {tally.total} tasks ran in {timeout:.0f}s")
            return False
        time.sleep(0.005)
    return True


@dataclass
class Run:
    args: argparse.Namespace
    work_dir: str
    procs: Processes
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    def broker(self, name: str, stops: list[Callable[[], None]]) -> None:
        server = start_server(name, self.args, self.procs, self.work_dir, stops, "delayed")
        out = self.results.setdefault(name, {"server": server.version})
        try:
            for part in self.args.only:
                out[part] = {"machine": quiet_check(f"{name} {part}", self.args.settle)}
                out[part].update(getattr(self, part)(server))
        finally:
            stops.remove(server.stop)
            server.stop()

    @contextmanager
    def workers(self, server: Server, tag: str, queue: str, count: int,
                env: dict[str, str]) -> Iterator[list[subprocess.Popen[bytes]]]:
        """``count`` workers ``-P threads -c 4`` on ``queue``, ready; stopped after."""
        group = Processes()
        names = [f"{server.name}-{tag}-{i}" for i in range(count)]
        try:
            started = [spawn_worker(group, self.work_dir, name, server.url, queue, env=env,
                                    wait=False) for name in names]
            await_ready(self.work_dir, started, names)
            yield started
        finally:
            group.stop_together()

    def fetched(self, server: Server, queue: str, workers: list[subprocess.Popen[bytes]]
                ) -> dict[str, Any]:
        """Until the queue is empty and the workers' RSS (MB) stays put for STABLE s,
        or the queue's count and RSS stay put for STILL s; at most ``--fetch-limit`` s."""
        start = time.monotonic()
        last, since = (-1, -1), start
        took: float | None = None
        while took is None and time.monotonic() - start < self.args.fetch_limit:
            state = (waiting(server.url, queue), int(rss_mb(tree(workers))))
            if state != last:
                last, since = state, time.monotonic()
            elif time.monotonic() - since >= (STILL if last[0] else STABLE):
                took = round(since - start, 1)
            time.sleep(0.5)
        log(f"{server.name}: " + (f"fetched in {took}s" if took is not None else
                                  f"still fetching after {self.args.fetch_limit:.0f}s")
            + f": {last[0]} waiting in the queue, workers' RSS {last[1]} MB")
        return {"fetch_s": took,
                "queue_after_fetch": last[0], "rss_fetched_mb": rss_mb(tree(workers))}

    def held(self, server: Server) -> dict[str, Any]:
        n, queue = self.args.held, f"held-{uuid.uuid4().hex[:6]}"
        log(f"{server.name}: held: publish {n:,} tasks countdown=3600")
        _, seconds = publish(server.url, queue, NOOP, n, lambda i: ((i,), {"countdown": 3600}))
        out: dict[str, Any] = {"held": n, "publish_per_s": round(n / seconds)}
        tally = Tally(os.path.join(self.work_dir, f"{server.name}-held.tally"), DUE)
        try:
            with self.workers(server, "held", queue, 1,
                              {"BENCH_TALLY_FILE": tally.path}) as workers:
                out["rss_ready_mb"] = rss_mb(tree(workers))
                out.update(self.fetched(server, queue, workers))
                app = make_app(server.url)
                task = app.tasks[TALLY]
                start = time.monotonic()
                with app.producer_or_acquire() as producer:
                    for index in range(DUE):
                        task.apply_async((index,), queue=queue, producer=producer)
                out["due_publish_s"] = round(time.monotonic() - start, 3)
                app.close()
                done = await_tally(tally, workers, f"{server.name} held", self.args.due_limit)
                summary = tally.summary() if tally.started() else None
                out.update(due_s=round(summary.last - start, 3) if done and summary else None,
                           due_ran=summary.distinct if summary else 0,
                           rss_end_mb=rss_mb(tree(workers)))
        finally:
            tally.close()
        log(f"{server.name}: held: {out['due_ran']} due tasks ran"
            + (f" in {out['due_s']}s" if out["due_s"] is not None else "")
            + f", RSS {out['rss_fetched_mb']:.0f} MB")
        return out

    def spread(self, server: Server) -> dict[str, Any]:
        n, span, queue = self.args.spread_tasks, self.args.span, f"spread-{uuid.uuid4().hex[:6]}"
        rng = random.Random(27)
        offsets = [rng.uniform(0.0, span) for _ in range(n)]
        log(f"{server.name}: spread: publish {n:,} tasks due over {span:.0f}s")
        base = time.time()

        def message(i: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
            eta = base + offsets[i]
            return (i, eta), {"eta": datetime.fromtimestamp(eta, timezone.utc)}
        _, seconds = publish(server.url, queue, LATE, n, message)
        out: dict[str, Any] = {"tasks": n, "span_s": span, "publish_s": round(seconds, 1),
                               "publish_per_s": round(n / seconds)}
        path = os.path.join(self.work_dir, f"{server.name}-spread.late")
        runs: dict[int, list[float]] = {}
        peak = 0.0
        with self.workers(server, "spread", queue, self.args.workers,
                          {"BENCH_LATE_FILE": path}) as workers:
            ready = time.time()
            cpu0 = cpu_seconds(tree(workers))
            deadline = base + span + max(60.0, span / 5)
            done = 0
            while len(runs) < n and time.time() < deadline:
                if any(w.poll() is not None for w in workers):
                    raise RuntimeError(f"{server.name} spread: a worker exited")
                peak = max(peak, rss_mb(tree(workers)))
                if os.path.exists(path):
                    with open(path, encoding="ascii") as fh:
                        fh.seek(done)
                        chunk = fh.read()
                    chunk = chunk[:chunk.rfind("\n") + 1]   # whole lines only
                    done += len(chunk)
                    for line in chunk.splitlines():
                        index, late = line.split()
                        runs.setdefault(int(index), []).append(float(late))
                time.sleep(1.0)
            cpu = cpu_seconds(tree(workers)) - cpu0
        due_after = [runs[i][0] * 1000 for i in runs if base + offsets[i] >= ready]
        # Once the tasks due while publishing are done: the lateness of tasks
        # coming due one by one, at the rate of the span.
        steady = [runs[i][0] * 1000 for i in runs if base + offsets[i] >= ready + CATCH_UP]
        out.update(due_before_ready=sum(base + o < ready for o in offsets), ran=len(runs),
                   ran_twice=sum(len(r) > 1 for r in runs.values()), not_run=n - len(runs),
                   peak_rss_mb=peak, cpu_s=round(cpu, 1))
        for key, values in (("late", due_after), ("steady", steady)):
            if values:
                out.update({f"{key}_{name}_ms": round(percentile(values, pct), 1)
                            for name, pct in (("p50", 50), ("p99", 99), ("max", 100))})
        log(f"{server.name}: spread: {len(runs):,} of {n:,} ran, p99 late "
            f"{out.get('late_p99_ms', float('nan')):.0f} ms")
        return out

    def backlog(self, server: Server) -> dict[str, Any]:
        out: dict[str, Any] = {"backlog": self.args.backlog}
        for label in ("no_backlog", "backlog"):
            queue = f"backlog-{uuid.uuid4().hex[:6]}"
            path = os.path.join(self.work_dir, f"{server.name}-{label}.tally")
            if label == "backlog":
                n = self.args.backlog
                log(f"{server.name}: backlog: publish {n:,} tasks countdown=86400")
                _, seconds = publish(server.url, queue, NOOP, n,
                                     lambda i: ((i,), {"countdown": 86400}))
                out["publish_per_s"] = round(n / seconds)
            with self.workers(server, label, queue, 1, {"BENCH_TALLY_FILE": path}) as workers:
                if label == "backlog":
                    out.update(self.fetched(server, queue, workers))
                    cpu0, packets0 = cpu_seconds(tree(workers)), server.client_packets()[0]
                    log(f"{server.name}: backlog: {self.args.idle:.0f}s idle")
                    time.sleep(self.args.idle)
                    out.update(idle_cpu_s=round(cpu_seconds(tree(workers)) - cpu0, 2),
                               idle_rss_mb=rss_mb(tree(workers)))
                    if server.zk is not None:
                        out["idle_zk_packets"] = server.client_packets()[0] - packets0
                log(f"{server.name}: backlog: drain {self.args.drain:,} ({label})")
                tally = Tally(path, self.args.drain)   # opened by a worker's first task
                try:
                    start, seconds = publish(server.url, queue, TALLY, self.args.drain,
                                             lambda i: ((i,), {}))
                    done = await_tally(tally, workers, f"{server.name} {label}",
                                       self.args.due_limit)
                    summary = tally.summary() if tally.started() else None
                finally:
                    tally.close()
                out[f"{label}_publish_s"] = round(seconds, 2)
                out[f"{label}_ran"] = summary.distinct if summary else 0
                if done and summary:
                    out[f"{label}_rate"] = round(summary.distinct
                                                 / max(1e-6, summary.last - summary.first))
                    out[f"{label}_end_to_end_s"] = round(summary.last - start, 2)
        log(f"{server.name}: backlog: drain/s {out.get('no_backlog_rate')} without, "
            f"{out.get('backlog_rate')} with")
        return out


ROWS: dict[str, list[tuple[str, str]]] = {
    "held": [("publish/s", "publish_per_s"), ("fetched after s", "fetch_s"),
             ("waiting in queue then", "queue_after_fetch"), ("RSS ready MB", "rss_ready_mb"),
             ("RSS fetched MB", "rss_fetched_mb"), ("RSS end MB", "rss_end_mb"),
             (f"{DUE} due tasks ran in s", "due_s"), ("due tasks ran", "due_ran")],
    "spread": [("publish s", "publish_s"), ("publish/s", "publish_per_s"),
               ("due before ready", "due_before_ready"), ("late p50 ms", "late_p50_ms"),
               ("late p99 ms", "late_p99_ms"), ("late max ms", "late_max_ms"),
               ("steady late p50 ms", "steady_p50_ms"), ("steady late p99 ms", "steady_p99_ms"),
               ("steady late max ms", "steady_max_ms"),
               ("ran", "ran"), ("ran twice", "ran_twice"), ("not run", "not_run"),
               ("peak RSS MB", "peak_rss_mb"), ("worker CPU s", "cpu_s")],
    "backlog": [("publish/s", "publish_per_s"), ("fetched after s", "fetch_s"),
                ("RSS fetched MB", "rss_fetched_mb"), ("idle CPU s", "idle_cpu_s"),
                ("idle RSS MB", "idle_rss_mb"), ("idle zk packets", "idle_zk_packets"),
                ("drain/s no backlog", "no_backlog_rate"), ("drain/s on backlog", "backlog_rate"),
                ("drain s no backlog", "no_backlog_end_to_end_s"),
                ("drain s on backlog", "backlog_end_to_end_s"),
                ("drain ran on backlog", "backlog_ran")],
}


def render(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    lines: list[str] = []
    for part in args.only:
        sizes = {"held": f"{args.held:,} held", "backlog": f"{args.backlog:,} backlog",
                 "spread": f"{args.spread_tasks:,} over {args.span:.0f}s"}[part]
        rows = [[f"{part} ({sizes})", *args.brokers]]
        for label, key in ROWS[part]:
            cells = [results[b].get(part, {}).get(key, "-") for b in args.brokers]
            if any(c != "-" for c in cells):   # None: not within the time allowed
                rows.append([label, *("-" if c == "-" else "late" if c is None else f"{c:,}"
                                      for c in cells)])
        lines += ["", *table(rows)]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default=",".join(BROKERS))
    parser.add_argument("--only", default=",".join(PARTS))
    parser.add_argument("--held", type=int, help="held: tasks countdown=3600 (20000)")
    parser.add_argument("--spread-tasks", type=int, help="spread: tasks (100000)")
    parser.add_argument("--span", type=float, help="spread: seconds the etas span (600)")
    parser.add_argument("--workers", type=int, default=1, help="spread: workers (1)")
    parser.add_argument("--backlog", type=int, help="backlog: tasks countdown=86400 (100000)")
    parser.add_argument("--idle", type=float, help="backlog: idle seconds measured (60)")
    parser.add_argument("--drain", type=int, help="backlog: tasks per drain (10000)")
    parser.add_argument("--fetch-limit", type=float,
                        help="longest wait for a worker to fetch the delayed tasks (600 s)")
    parser.add_argument("--due-limit", type=float,
                        help="longest wait for the due tasks or a drain to run (300 s)")
    parser.add_argument("--settle", type=float, default=60.0,
                        help="seconds to wait for a quiet machine before each part")
    parser.add_argument("--quick", action="store_true", help="small sizes everywhere")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    add_server_options(parser)
    args = parser.parse_args(argv)
    quick = args.quick
    args.held = args.held or (1000 if quick else 20000)
    args.spread_tasks = args.spread_tasks or (2000 if quick else 100000)
    args.span = args.span or (30.0 if quick else 600.0)
    args.backlog = args.backlog or (5000 if quick else 100000)
    args.idle = args.idle if args.idle is not None else (10.0 if quick else 60.0)
    args.drain = args.drain or (2000 if quick else 10000)
    args.fetch_limit = args.fetch_limit or (30.0 if quick else 600.0)
    args.due_limit = args.due_limit or (30.0 if quick else 300.0)
    if quick:
        args.zk_warm_up = min(args.zk_warm_up, 2.0)
        args.settle = min(args.settle, 5.0)
    args.brokers = choose(parser, args.brokers, BROKERS)
    args.only = choose(parser, args.only, PARTS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = run_info()
    with bench_run("celery-zk-delayed-", args.keep) as (procs, work_dir, stops):
        run = Run(args, work_dir, procs)
        for name in args.brokers:
            run.broker(name, stops)
    print(render(run.results, args))
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": info, "results": run.results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
