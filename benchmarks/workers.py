"""The side by side: celery_zk against Redis and RabbitMQ as worker processes are added.

Each broker in turn, back to back in this process, only its server running
(zk: server defaults; Redis: no persistence; RabbitMQ: Debian's, durable
queues); real ``celery worker`` processes running :mod:`common.app`. The
production shape (:mod:`common.servers`): ``zk3``, a three-member ensemble,
against ``rabbitmq3``, a three-node RabbitMQ cluster with quorum queues and
confirmed publishes, each member on a host of its own; ``memory``: Celery
alone (kombu's in-process transport, the backlog stored by the worker before
it consumes; K = 1 and the single workers only): the ceiling no broker passes.

(scaling) K = 1, 4, 16 workers ``-P threads -c 1`` drain one stored queue of
          ``--tasks`` no-op tasks, started together at a gate: tasks/s, CPU
          per task machine-wide (:mod:`common.machine`), for zk all and failed
          ZooKeeper transactions per task (the server's log, :mod:`common.txnlog`).
(single)  one ``-P threads -c 4`` and one ``-P prefork -c 4`` worker, the same way
          (``--pools prefork``: only that one).
(latency) :mod:`common.latency`'s shapes, idle and under ``--load`` tasks/s.

Usage::

    .venv/bin/python benchmarks/workers.py [--quick] [--brokers zk,redis,rabbitmq,...]
        [--ks 1,4,16] [--tasks 20000] [--single-tasks 10000] [--only scaling,single,latency]
        [--rounds 1] [--zk-option KEY=VALUE] [--json out.json]

``--rounds N``: the whole run N times, the brokers' order reversed each round
(so neither side of a ratio is always measured later). Each figure reported
is the median of the rounds'; each target the median of the ratios taken
within each round, listed round by round. On a shared 2-core machine one
drain of 16 processes moves by a third between runs a minute apart, on any
broker (docs/performance.md).

Against another checkout: ``PYTHONPATH=/path/to/checkout``, run from a
directory that is no repository (the workers would import its celery_zk).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from common import txnlog
from common.app import preload
from common.figures import log, run_info, write_json
from common.latency import Latency
from common.machine import CLK_TCK, FOREIGN, QUIET, CpuWindow, quiet_check, run_pids
from common.processes import Processes, bench_run
from common.report import median_of, render
from common.servers import Server, add_server_options, choose, start_server
from common.tally import Tally
from common.worker import await_ready, spawn_worker

BROKERS = ("zk", "redis", "rabbitmq", "zk3", "rabbitmq3", "memory")
DEFAULT_BROKERS = "zk,redis,rabbitmq"
PARTS = ("scaling", "single", "latency")
SINGLE = (("threads", 4), ("prefork", 4))
POLL = 0.005         # the client's look at the tally: ±5 ms on a drain of seconds


# -- the run -------------------------------------------------------------------------------
@dataclass
class Run:
    args: argparse.Namespace
    work_dir: str
    procs: Processes
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    def broker(self, name: str, stops: list[Callable[[], None]]) -> None:
        args = self.args
        server = start_server(name, args, self.procs, self.work_dir, stops, "workers")
        out = self.results.setdefault(name, {"server": server.version})
        try:
            if "scaling" in args.only:
                for k in (args.ks if name != "memory" else [1]):
                    out.setdefault("scaling", {})[str(k)] = self.undisturbed(
                        server, f"k{k}", k, "threads", 1, args.tasks)
            if "single" in args.only:
                for pool, concurrency in SINGLE:
                    if pool not in args.pools:
                        continue
                    out.setdefault("single", {})[f"{pool} -c {concurrency}"] = self.undisturbed(
                        server, pool, 1, pool, concurrency, args.single_tasks)
            if "latency" in args.only and name != "memory":
                out["latency"] = self.latency(server)
        finally:
            stops.remove(server.stop)
            server.stop()

    def undisturbed(self, server: Server, label: str, k: int, pool: str, concurrency: int,
                    total: int) -> dict[str, Any]:
        """:meth:`drain`, again (up to ``--retries`` times) while something else ran;
        the least disturbed attempt is kept, the others' figures noted in it."""
        attempts: list[dict[str, Any]] = []
        for attempt in range(1 + self.args.retries):
            entry = self.drain(server, f"{label}-{attempt}" if attempt else label, k, pool,
                               concurrency, total)
            entry["attempt"] = attempt + 1
            attempts.append(entry)
            if entry["busy_cores_before"] <= QUIET and entry["others_share"] <= FOREIGN:
                break
            log(f"{server.name}: {label}: disturbed"
                + ("; once more" if attempt < self.args.retries else ""))
        best = min(attempts, key=lambda e: (e["busy_cores_before"] > QUIET, e["others_share"]))
        best["discarded"] = [{key: e[key] for key in ("attempt", "rate", "cpu_ms_per_task",
                                                      "others_share", "busy_cores_before")}
                             for e in attempts if e is not best]
        return best

    def drain(self, server: Server, label: str, k: int, pool: str, concurrency: int,
              total: int) -> dict[str, Any]:
        """K workers drain ``total`` stored tasks, started together at the gate."""
        tag = f"{server.name}-{label}"
        queue = f"workers-{label}-{uuid.uuid4().hex[:6]}"
        log(f"{server.name}: {label}: store {total:,} tasks, then {k} worker(s) "
            f"-P {pool} -c {concurrency}")
        env = {}
        if server.name == "memory":   # the worker's own queue, stored as it starts
            env["BENCH_PRELOAD"] = str(total)
        else:
            preload(server.url, queue, total)
        tally = Tally(os.path.join(self.work_dir, f"{tag}.tally"), total)
        gate = os.path.join(self.work_dir, f"{tag}.gate")
        before = server.zxid() if server.zk else 0
        packets_before = server.client_packets()
        group = Processes()   # these workers only: stopped together, then counted
        entry: dict[str, Any] = {"tasks": total, "workers": k, "pool": pool,
                                 "concurrency": concurrency}
        try:
            workers = [spawn_worker(group, self.work_dir, f"{tag}-{i}", server.url, queue,
                                    pool=pool, concurrency=concurrency, wait=False,
                                    env={"BENCH_TALLY_FILE": tally.path,
                                         "BENCH_GATE_FILE": gate, **env})
                       for i in range(k)]
            await_ready(self.work_dir, workers, [f"{tag}-{i}" for i in range(k)])
            entry.update(quiet_check(f"{server.name} {label}", self.args.settle))
            server_groups = [os.getpgid(pid) for pid in server.pids]
            parts = {"server": run_pids(server_groups, server.pids),
                     "workers": run_pids([w.pid for w in workers], []),
                     "bench": [os.getpid()]}
            window = CpuWindow(parts)
            opened = time.monotonic()
            open(gate, "w").close()
            self.watch(tally, workers, opened, total, tag, window)
            summary = tally.summary()
        finally:
            group.stop_together()
            tally.close()
        elapsed = summary.last - summary.first
        jiffies = window.machine
        entry.update(window.report(f"{server.name} {label}"))
        entry.update(rate=total / elapsed, elapsed=elapsed,
                     cpu_ms_per_task=jiffies * 1000 / CLK_TCK / total,
                     cpu_ms_per_task_by_part={name: round(j * 1000 / CLK_TCK / total, 3)
                                              for name, j in window.by_part.items()},
                     busy_cores=jiffies / CLK_TCK / elapsed,
                     first_after_gate_ms=(summary.first - opened) * 1000,
                     **{key: value for key, value in asdict(summary).items()
                        if key not in ("first", "last")})
        if server.zk is not None:
            entry.update(self.transactions(server, before, total))
            received, sent = (b - a for a, b in zip(packets_before, server.client_packets()))
            entry.update(requests_per_message=received / total,
                         packets_sent_per_message=sent / total)
        log(f"{server.name}: {label}: {entry['rate']:,.0f} tasks/s, "
            f"{entry['cpu_ms_per_task']:.2f} ms CPU per task ("
            + ", ".join(f"{name} {ms:.2f}"
                        for name, ms in entry["cpu_ms_per_task_by_part"].items()) + ")"
            + (f", {entry['failed_per_message']:.3f} failed transactions per task"
               if "failed_per_message" in entry else ""))
        return entry

    def watch(self, tally: Tally, workers: list[subprocess.Popen[bytes]], opened: float,
              total: int, tag: str, window: CpuWindow) -> None:
        """``window`` from the first task start seen to the last task."""
        deadline = opened + max(300.0, total / 10)
        started = False
        next_check = 0.0
        while True:
            if not started and tally.started():
                window.start()
                started = True
            if tally.done():
                if not started:
                    window.start()
                window.stop()
                return
            now = time.monotonic()
            if now > next_check:   # not every turn: the client's CPU counts too
                next_check = now + 0.5
                for proc in workers:
                    if proc.poll() is not None:
                        raise RuntimeError(f"{tag}: a worker exited ({proc.returncode})")
                if now > deadline:
                    raise RuntimeError(f"{tag}: {total} tasks not drained in "
                                       f"{deadline - opened:.0f}s")
            time.sleep(POLL)

    @staticmethod
    def transactions(server: Server, before: int, total: int) -> dict[str, Any]:
        """ZooKeeper's transactions over the workers' lifetime, the failed ones
        (conflicts) too, read from the server's log."""
        assert server.zk is not None
        counts = txnlog.count(server.zk.data_dir, before, server.zxid())
        return {"server_txns": {**asdict(counts), "failed": counts.failed},
                "failed_per_message": counts.failed / total,
                "txns_per_message": counts.transactions / total}

    def latency(self, server: Server) -> dict[str, Any]:
        """:mod:`common.latency`'s shapes, idle and loaded, on this server."""
        probe = Latency(server.name, server.url, server.backend, self.procs, self.work_dir)
        out: dict[str, Any] = {}
        for rate, label in ((0.0, "idle"), (self.args.load, "loaded")):
            log(f"{server.name}: latency, {label}")
            out["machine " + label] = quiet_check(f"{server.name} latency {label}",
                                                  self.args.settle)
            # The worker and the load process start and end inside: ours as reaped children.
            window = CpuWindow({"run": run_pids([os.getpgid(pid) for pid in server.pids],
                                                [*server.pids, os.getpid()])})
            window.start()
            for shape, figures in probe.measure(self.args.samples, rate).items():
                out[f"{shape} {label}"] = figures
            window.stop()
            out["machine " + label].update(window.report(f"{server.name} latency {label}"))
        return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default=DEFAULT_BROKERS,
                        help=f"some of {','.join(BROKERS)} (default {DEFAULT_BROKERS})")
    parser.add_argument("--only", default=",".join(PARTS))
    parser.add_argument("--ks", help="worker processes per scaling drain (default 1,4,16)")
    parser.add_argument("--tasks", type=int, help="scaling backlog (default 20000)")
    parser.add_argument("--single-tasks", type=int, help="single-worker backlog (10000)")
    parser.add_argument("--pools", default="threads,prefork",
                        help="the single-worker pools to run (default threads,prefork)")
    parser.add_argument("--samples", type=int, help="latency samples per shape (200)")
    parser.add_argument("--load", type=float, default=200.0, help="background tasks/s")
    parser.add_argument("--settle", type=float, default=120.0,
                        help="seconds to wait for a quiet machine before a measurement")
    parser.add_argument("--retries", type=int, default=2,
                        help="times a drain is repeated when something else ran meanwhile")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run everything this many times; report medians")
    parser.add_argument("--quick", action="store_true", help="small sizes, K = 1, 4")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    add_server_options(parser)
    args = parser.parse_args(argv)
    quick = args.quick
    args.ks = [int(k) for k in (args.ks or ("1,4" if quick else "1,4,16")).split(",")]
    # Drains of several seconds at 2,000-4,000 tasks/s: a 6,000-task one lasted
    # 1.5 s, and a host's stall of 100-200 ms moved its rate by a tenth.
    args.tasks = args.tasks or (600 if quick else 20000)
    args.single_tasks = args.single_tasks or (300 if quick else 10000)
    args.pools = choose(parser, args.pools, [pool for pool, _ in SINGLE])
    args.samples = args.samples or (20 if quick else 200)
    if quick:   # checks the parts, measures nothing
        args.zk_warm_up = min(args.zk_warm_up, 2.0)
    if args.rounds < 1:
        parser.error(f"--rounds must be 1 or more (got {args.rounds})")
    args.brokers = choose(parser, args.brokers, BROKERS)
    args.only = choose(parser, args.only, PARTS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = run_info()
    if info["loadavg1_at_start"] > QUIET:
        log(f"WARNING: load average {info['loadavg1_at_start']:.2f} before the run: "
            "is something else running?")
    rounds: list[dict[str, dict[str, Any]]] = []
    with bench_run("celery-zk-workers-", args.keep) as (procs, work_dir, stops):
        if args.rounds > 1:
            os.chmod(work_dir, 0o755)   # user rabbitmq reaches each round's dir through it
        run = Run(args, work_dir, procs)
        for number in range(args.rounds):
            order = args.brokers if number % 2 == 0 else args.brokers[::-1]
            if args.rounds > 1:   # a server's files are made anew each round
                run.work_dir = os.path.join(work_dir, f"round-{number + 1}")
                os.makedirs(run.work_dir)
                log(f"round {number + 1} of {args.rounds}: {', '.join(order)}")
            run.results = {}
            for name in order:
                run.broker(name, stops)
            # Reported in the brokers' order, whatever order the round ran them in.
            rounds.append({name: run.results[name] for name in args.brokers})
    results = rounds[0] if len(rounds) == 1 else median_of(rounds)
    print(render(results, info, args, rounds))
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": info, "results": results,
                               **({"rounds": rounds} if len(rounds) > 1 else {})})
    return 0


if __name__ == "__main__":
    sys.exit(main())
