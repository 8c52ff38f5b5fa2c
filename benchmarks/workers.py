"""Throughput as worker processes are added: celery_zk against Redis and RabbitMQ (issue 26).

Each broker in turn, back to back in this process, only its server running
(zk: server defaults; Redis: no persistence; RabbitMQ: Debian's, durable
queues); real ``celery worker`` processes running ``bench_app.py``. See
benchmarks/README.md, "Throughput as workers are added".

(scaling) K = 1, 4, 16 workers ``-P threads -c 1`` drain one stored queue of
          ``--tasks`` no-op tasks, started together at a gate: tasks/s, CPU
          per task machine-wide (``machine.py``), for zk failed ZooKeeper
          transactions per task (server's log, ``txnlog.py``; workers' CLAIMS).
(single)  one ``-P threads -c 4`` and one ``-P prefork -c 4`` worker, the same way
          (``--pools prefork``: only that one).
(latency) ``shapes.py``'s latency shapes, idle and under ``--load`` tasks/s.

Usage::

    .venv/bin/python benchmarks/workers.py [--quick] [--brokers zk,redis,rabbitmq]
        [--ks 1,4,16] [--tasks 20000] [--single-tasks 10000] [--only scaling,single,latency]
        [--rounds 1] [--zk-option KEY=VALUE] [--json out.json]

``--rounds N``: the whole run N times, the brokers' order reversed each round
(so neither side of a ratio is always measured later). Each figure reported
is the median of the rounds'; each target the median of the ratios taken
within each round, listed round by round. On a shared 2-core machine one
drain of 16 processes moves by a third between runs a minute apart, on any
broker (benchmarks/README.md).

Against another checkout: ``PYTHONPATH=/path/to/checkout``, run from a
directory that is no repository (the workers would import its celery_zk).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import txnlog  # noqa: E402
from bench_app import TALLY, make_app  # noqa: E402
from common import (  # noqa: E402
    Processes,
    RabbitServer,
    RedisServer,
    add_server_options,
    add_zk_option,
    log,
    measured_server,
    spawn_worker,
    tail,
    warm_up_zookeeper,
    write_json,
)
from kombu import Connection  # noqa: E402
from machine import CLK_TCK, FOREIGN, QUIET, CpuWindow, quiet_check, run_pids  # noqa: E402
from tally import Tally  # noqa: E402
from workers_report import median_of, render  # noqa: E402

import celery_zk  # noqa: E402
from celery_zk.server import ZooKeeperServer, four_letter_word  # noqa: E402

BROKERS = ("zk", "redis", "rabbitmq")
PARTS = ("scaling", "single", "latency")
SINGLE = (("threads", 4), ("prefork", 4))
POLL = 0.005         # the client's look at the tally: ±5 ms on a drain of seconds


# -- the run's checkout ----------------------------------------------------------------
def checkout() -> dict[str, str]:
    """The celery_zk this run imports (its commit), and a warning when the current
    directory holds another one: ``python -m celery`` workers would import that."""
    used = os.path.dirname(os.path.dirname(os.path.abspath(celery_zk.__file__)))
    cwd = os.getcwd()
    if os.path.isfile(os.path.join(cwd, "celery_zk", "__init__.py")) and \
            os.path.realpath(cwd) != os.path.realpath(used):
        log(f"WARNING: run from {cwd}, a celery_zk checkout, while importing {used}: the "
            "workers import the current directory's; run from another directory")
    git = subprocess.run(["git", "-C", used, "describe", "--always", "--dirty"],
                         capture_output=True, text=True)
    return {"path": used, "commit": git.stdout.strip() or "not a git checkout"}


# -- servers -------------------------------------------------------------------------------
@dataclass
class Server:
    name: str
    url: str
    backend: str
    version: str
    stop: Callable[[], None]
    pids: list[int]    # the server's processes (their process groups count as the server)
    zk: ZooKeeperServer | None = None

    def zxid(self) -> int:
        assert self.zk is not None and self.zk.port is not None
        return txnlog.last_zxid(self.zk.host, self.zk.port)


def start_server(name: str, args: argparse.Namespace, procs: Processes, work_dir: str,
                 stops: list[Callable[[], None]]) -> Server:
    """``name``'s server, its stop pushed on ``stops`` first (stopped even if it fails)."""
    if name == "zk":
        zk = measured_server(args)

        def stop_zk() -> None:
            try:   # kombu's pools keep this process's session: not against a stopped server
                from celery_zk.zk.session import close_all
                close_all(zk.hosts)
            except ImportError:
                pass
            zk.close()
        stops.append(stop_zk)
        zk.start()
        warm_up_zookeeper(zk.hosts)
        query = "?" + "&".join(args.zk_option) if args.zk_option else ""
        import shapes  # a script: imported only for this
        shapes.warm_up_with_load(procs, work_dir, f"{zk.url}/warm-up{query}", args.zk_warm_up)
        srvr = four_letter_word(zk.host, zk.port or 0, "srvr").splitlines()[0]
        return Server(name, f"{zk.url}/workers{query}", f"{zk.url}/workers-results{query}",
                      srvr, stop_zk, [zk.pid or 0], zk)
    if name == "redis":
        redis = RedisServer(procs, work_dir)

        def stop_redis() -> None:
            if redis.proc in procs.procs:
                procs.stop_and_remove(redis.proc)
        stops.append(stop_redis)
        redis.start()
        assert redis.proc is not None
        return Server(name, redis.url(0), redis.url(1), f"Redis {redis.version()}",
                      stop_redis, [redis.proc.pid])
    rabbit = RabbitServer(procs, work_dir)
    stops.append(rabbit.stop)
    log("starting RabbitMQ")
    rabbit.start()
    assert rabbit.proc is not None
    return Server(name, rabbit.url(), "rpc://", f"RabbitMQ {rabbit.version()}", rabbit.stop,
                  [rabbit.proc.pid, rabbit.beam])


def waiting(url: str, queue: str) -> int:
    with Connection(url) as conn:
        return int(conn.default_channel.queue_declare(queue, passive=True).message_count)


def preload(url: str, queue: str, total: int) -> None:
    """``total`` ``bench.tally`` tasks (indexes 0..total-1), stored before any worker runs."""
    app = make_app(url)
    if url.startswith("zk://"):   # pipelined: the preload is not what is measured
        app.conf.broker_transport_options = {"confirm_publish": False}
    task = app.tasks[TALLY]
    try:
        with app.producer_or_acquire() as producer:
            for index in range(total):
                task.apply_async((index,), queue=queue, producer=producer)
    finally:
        app.close()
    deadline = time.monotonic() + 300
    while (stored := waiting(url, queue)) < total:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: only {stored} of {total} tasks stored in {queue}")
        time.sleep(0.2)


def await_ready(work_dir: str, workers: list[subprocess.Popen[bytes]], names: list[str]
                ) -> None:
    """Wait until each of ``workers`` (``spawn_worker(..., wait=False)``, named
    ``names``) consumes; RuntimeError with its output if one exits or is late."""
    deadline = time.monotonic() + 60 + 15 * len(workers)
    for proc, name in zip(workers, names):
        while not os.path.exists(os.path.join(work_dir, f"{name}.ready")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {name} did not become ready (exit "
                                   f"{proc.poll()}):\n"
                                   f"{tail(os.path.join(work_dir, name + '.out'))}")
            time.sleep(0.05)


# -- the run -------------------------------------------------------------------------------
@dataclass
class Run:
    args: argparse.Namespace
    work_dir: str
    procs: Processes = field(default_factory=Processes)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    def broker(self, name: str, stops: list[Callable[[], None]]) -> None:
        args = self.args
        server = start_server(name, args, self.procs, self.work_dir, stops)
        out = self.results.setdefault(name, {"server": server.version})
        try:
            if "scaling" in args.only:
                for k in args.ks:
                    out.setdefault("scaling", {})[str(k)] = self.undisturbed(
                        server, f"k{k}", k, "threads", 1, args.tasks)
            if "single" in args.only:
                for pool, concurrency in SINGLE:
                    if pool not in args.pools:
                        continue
                    out.setdefault("single", {})[f"{pool} -c {concurrency}"] = self.undisturbed(
                        server, pool, 1, pool, concurrency, args.single_tasks)
            if "latency" in args.only:
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
        preload(server.url, queue, total)
        tally = Tally(os.path.join(self.work_dir, f"{tag}.tally"), total)
        gate = os.path.join(self.work_dir, f"{tag}.gate")
        claims = [os.path.join(self.work_dir, f"{tag}-{i}.claims") for i in range(k)]
        zxid = server.zxid() if server.zk else 0
        group = Processes()   # these workers only: stopped together, then counted
        entry: dict[str, Any] = {"tasks": total, "workers": k, "pool": pool,
                                 "concurrency": concurrency}
        try:
            workers = [spawn_worker(group, self.work_dir, f"{tag}-{i}", server.url, queue,
                                    pool=pool, concurrency=concurrency, wait=False,
                                    env={"BENCH_TALLY_FILE": tally.path,
                                         "BENCH_GATE_FILE": gate,
                                         "BENCH_CLAIMS_FILE": claims[i]})
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
            group.stop_together()   # warm shutdown: bench_app writes the claim counts
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
            entry.update(self.transactions(server, zxid, claims, total))
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
    def transactions(server: Server, zxid: int, claims: list[str], total: int
                     ) -> dict[str, Any]:
        """Failed ZooKeeper transactions over the workers' lifetime: the server's log
        and, while the transport keeps them, the workers' claim counts."""
        assert server.zk is not None
        counts = txnlog.count(server.zk.data_dir, zxid, server.zxid())
        out: dict[str, Any] = {"server_txns": {**asdict(counts), "failed": counts.failed},
                               "failed_per_message": counts.failed / total,
                               "txns_per_message": counts.transactions / total}
        found = [json.load(open(path, encoding="utf-8")) for path in claims
                 if os.path.exists(path)]
        if found:
            client = {key: sum(c[key] for c in found) for key in found[0]}
            out.update(client_claims=client, conflicts_per_message=client["conflicts"] / total)
        return out

    def latency(self, server: Server) -> dict[str, Any]:
        """``shapes.py``'s measurement, idle and loaded, on this server."""
        import shapes  # a script: imported only for this part
        broker = shapes.Broker(server.name, server.url, server.backend, self.procs,
                               self.work_dir, self.args)
        out: dict[str, Any] = {}
        for rate, label in ((0.0, "idle"), (self.args.load, "loaded")):
            log(f"{server.name}: latency, {label}")
            out["machine " + label] = quiet_check(f"{server.name} latency {label}",
                                                  self.args.settle)
            # The worker and the load process start and end inside: ours as reaped children.
            window = CpuWindow({"run": run_pids([os.getpgid(pid) for pid in server.pids],
                                                [*server.pids, os.getpid()])})
            window.start()
            for shape, figures in broker.latency(self.args.samples, rate).items():
                out[f"{shape} {label}"] = figures
            window.stop()
            out["machine " + label].update(window.report(f"{server.name} latency {label}"))
        return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default=",".join(BROKERS))
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
    add_zk_option(parser)
    args = parser.parse_args(argv)
    quick = args.quick
    args.ks = [int(k) for k in (args.ks or ("1,4" if quick else "1,4,16")).split(",")]
    # Drains of several seconds at 2,000-4,000 tasks/s: a 6,000-task one lasted
    # 1.5 s, and a host's stall of 100-200 ms moved its rate by a tenth.
    args.tasks = args.tasks or (600 if quick else 20000)
    args.single_tasks = args.single_tasks or (300 if quick else 10000)
    args.pools = [p for p in args.pools.split(",") if p]
    unknown = set(args.pools) - {pool for pool, _ in SINGLE}
    if unknown:
        parser.error(f"--pools: unknown {', '.join(sorted(unknown))}; "
                     f"choose from {', '.join(pool for pool, _ in SINGLE)}")
    args.samples = args.samples or (20 if quick else 200)
    if quick:   # checks the parts, measures nothing
        args.zk_warm_up = min(args.zk_warm_up, 2.0)
    if args.rounds < 1:
        parser.error(f"--rounds must be 1 or more (got {args.rounds})")
    args.brokers = [b for b in args.brokers.split(",") if b]
    args.only = [p for p in args.only.split(",") if p]
    for value, known in ((args.brokers, BROKERS), (args.only, PARTS)):
        for item in value:
            if item not in known:
                parser.error(f"unknown {item!r}: choose from {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))   # clean up as on Ctrl-C
    info: dict[str, Any] = {"celery_zk": checkout(), "nproc": os.cpu_count(),
                            "loadavg1_at_start": round(os.getloadavg()[0], 2)}
    if info["loadavg1_at_start"] > QUIET:
        log(f"WARNING: load average {info['loadavg1_at_start']:.2f} before the run: "
            "is something else running?")
    work_dir = tempfile.mkdtemp(prefix="celery-zk-workers-")
    if args.rounds > 1:
        os.chmod(work_dir, 0o755)   # user rabbitmq reaches each round's dir through it
    rounds: list[dict[str, dict[str, Any]]] = []
    run = Run(args, work_dir)
    stops: list[Callable[[], None]] = []
    try:
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
    finally:
        run.procs.stop_all()
        for stop in reversed(stops):
            stop()
        if args.keep:
            log(f"work dir kept: {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    results = rounds[0] if len(rounds) == 1 else median_of(rounds)
    print(render(results, info, args, rounds))
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": info, "results": results,
                               **({"rounds": rounds} if len(rounds) > 1 else {})})
    return 0


if __name__ == "__main__":
    sys.exit(main())
