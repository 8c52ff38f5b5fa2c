"""Benchmark celery_zk against Redis and kombu's built-in ``zookeeper://``.

One run starts its own ZooKeeper (celery_zk's launcher) and ``redis-server``
on free ports, measures each broker with real ``celery worker`` processes
(threads pool, ``-c 4``) and stops everything it started, also on Ctrl-C.

Measurements (see benchmarks/README.md for what each one means):

(a) idle-worker round trip: one task at a time; the task publishes a reply
    on the same broker and the client waits for it (p50/p99, ms).
(b) drain: a backlog published while no worker runs, then drained by one
    4-thread worker (tasks/s, first to last task executed).
(c) publish: ``apply_async`` from one client, no worker (msgs/s).
(d) result round trip: ``delay(...).get()`` with celery_zk's result backend
    vs Celery's redis backend (only when ``celery_zk.backend`` is usable).
(e) floor: the bare ZooKeeper requests of (a) and (d) between two plain
    kazoo processes, no Celery (``floor.py``); a lower bound for (a) and (d).

This file is the run: options, what runs in which order, the notes. How each
measurement is taken: ``bench_measure.py``; the table and the targets:
``bench_report.py``; servers and workers: ``common.py``.

Usage::

    .venv/bin/python benchmarks/bench.py [--quick] [--only zk,redis,kombu-zk]
        [--tasks 5000] [--latency-samples 200] [--zk-force-sync yes|no] [--json out.json]
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_measure import BROKERS, Bench  # noqa: E402
from bench_report import filesystem_of, machine, render  # noqa: E402
from common import (  # noqa: E402
    REDIS_SERVER,
    Processes,
    RedisServer,
    add_server_options,
    add_zk_option,
    fmt,
    log,
    measured_server,
    warm_up_zookeeper,
    write_json,
)

import celery_zk  # noqa: E402,F401  (registers zk://)
from celery_zk.server import SERVER_JVM_FLAGS, ZooKeeperServer  # noqa: E402

REDIS_HELP = ("redis-server not found at /usr/bin/redis-server. Install Debian's package "
              "(sudo apt-get install redis-server){dev}, then run the benchmark again.")

#: kombu's zookeeper transport polls every second (polling_interval=1), so a
#: round trip takes ~1-2 s and its drain is slow: it gets smaller defaults.
KOMBU_ZK_LATENCY_SAMPLES = 30
KOMBU_ZK_DRAIN_BUDGET = 60.0   # seconds the kombu-zk drain should take at most


def backend_available() -> str | None:
    """None if celery_zk's result backend resolves, else why not."""
    try:
        from celery import Celery

        from celery_zk.backend import ZooKeeperBackend
        backend = Celery(result_backend="zk://127.0.0.1:1/x", set_as_current=False).backend
        if not isinstance(backend, ZooKeeperBackend):
            return f"zk:// resolved to {type(backend).__module__}"
    except Exception as exc:  # any failure means: not ready yet
        return f"{type(exc).__name__}: {exc}"
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small sizes (500 tasks, 40 samples, 500 publishes) for a smoke run")
    p.add_argument("--only", default=",".join(BROKERS),
                   help="comma-separated brokers to run: zk,redis,kombu-zk (default all)")
    p.add_argument("--tasks", type=int, default=None, help="drain backlog (default 5000)")
    p.add_argument("--latency-samples", type=int, default=None,
                   help="round-trip samples per broker (default 200; kombu-zk 30)")
    p.add_argument("--publish", type=int, default=None, help="publishes (default 2000)")
    add_server_options(p)
    add_zk_option(p)
    p.add_argument("--skip", default="",
                   help="comma-separated measurements to skip: "
                        "latency,drain,publish,result,floor")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.only = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = set(args.only) - set(BROKERS)
    if unknown:
        p.error(f"--only: unknown broker(s) {sorted(unknown)}; choose from {BROKERS}")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    quick = args.quick
    args.tasks = args.tasks or (500 if quick else 5000)
    args.latency_samples = args.latency_samples or (40 if quick else 200)
    args.publish = args.publish or (500 if quick else 2000)
    return args


def plan(args: argparse.Namespace, name: str) -> tuple[int, int]:
    """(latency samples, drain backlog) for a broker."""
    if name != "kombu-zk":
        return args.latency_samples, args.tasks
    return min(args.latency_samples, KOMBU_ZK_LATENCY_SAMPLES), args.tasks


def run(args: argparse.Namespace) -> int:
    if "redis" in args.only:
        if not os.access(REDIS_SERVER, os.X_OK):
            dev = " or ./dev bench (which installs it)" if os.path.exists(
                os.path.join(HERE, "..", "dev")) else ""
            print(REDIS_HELP.format(dev=dev), file=sys.stderr)
            return 1
    random.seed(1)
    procs = Processes()
    work_dir = tempfile.mkdtemp(prefix="celery-zk-bench-")
    zk: ZooKeeperServer | None = None
    bench = Bench(args, procs, work_dir)
    try:
        zk = measured_server(args)
        zk.start()
        redis = RedisServer(procs, work_dir).start()
        run_id = uuid.uuid4().hex[:8]
        query = "?" + "&".join(args.zk_option) if args.zk_option else ""
        bench.urls = {"zk": f"zk://{zk.hosts}/bench-{run_id}{query}",
                      "redis": redis.url(0),
                      "kombu-zk": f"zookeeper://{zk.hosts}/kombu-bench-{run_id}"}
        bench.backends = {"zk": f"zk://{zk.hosts}/bench-results-{run_id}{query}",
                          "redis": redis.url(1)}
        info = machine(args, zk, redis)
        log("  ".join(f"{k}={v}" for k, v in info.items()))
        log(f"ZooKeeper {zk.hosts} (data {zk.data_dir}), redis-server 127.0.0.1:{redis.port}")
        no_backend = backend_available()
        if no_backend and "result" not in args.skip:
            log(f"(d) result round trip skipped: backend not available ({no_backend})")
            bench.notes.append("result round trip skipped: backend not available")
            args.skip.add("result")

        warm_up_zookeeper(zk.hosts)
        selected = [b for b in BROKERS if b in args.only]
        if "floor" not in args.skip and "zk" in args.only:
            bench.floor(zk.hosts, args.latency_samples)
        if "publish" not in args.skip:
            bench.publish_rounds(selected, query)
        for name in selected:
            res = bench.results.setdefault(name, {})
            samples, backlog = plan(args, name)
            if "latency" not in args.skip:
                log(f"{name}: (a) idle round trip x{samples}")
                res.update(bench.latency(name, samples))
            if "drain" not in args.skip:
                if name == "kombu-zk":
                    # Keep its drain within the budget; estimate from a probe drain.
                    probe = bench.drain(name, min(200, backlog))
                    fits = int(probe["drain_rate"] * KOMBU_ZK_DRAIN_BUDGET)
                    if fits < backlog:
                        bench.notes.append(
                            f"kombu-zk drain used a {fits}-task backlog instead of {backlog}: "
                            f"at its probed {probe['drain_rate']:.0f} tasks/s the full backlog "
                            f"would take > {KOMBU_ZK_DRAIN_BUDGET:.0f}s")
                        backlog = max(200, fits)
                log(f"{name}: (b) drain a {backlog}-task backlog")
                res.update(bench.drain(name, backlog))
            if "result" not in args.skip and name in bench.backends:
                log(f"{name}: (d) result round trip x{args.latency_samples}")
                res.update(bench.result(name, args.latency_samples))
            log(f"{name}: " + ", ".join(f"{k}={fmt(v)}" for k, v in res.items()))

        if "kombu-zk" in args.only and "latency" not in args.skip:
            bench.notes.append(
                f"kombu-zk polls every 1 s (its polling_interval), so its round trip is "
                f"~1-2 s; it ran {plan(args, 'kombu-zk')[0]} samples instead of "
                f"{args.latency_samples}")
        bench.notes.append(
            f"ZooKeeper forceSync={args.zk_force_sync} (data dir on "
            f"{filesystem_of(zk.data_dir)}); redis-server runs with no persistence "
            "(--save '' --appendonly no)")
        bench.notes.append(
            "ZooKeeper runs with production JVM flags (" + " ".join(
                f for f in SERVER_JVM_FLAGS if f.startswith("-X")) + ", full JIT) and "
            "tickTime=2000" + "".join(f"; {flag}" for flag in args.zk_jvm_flag))
        if args.zk_option:
            bench.notes.append("zk URLs with " + " ".join(args.zk_option))
        bench.notes.append("drain/s is first to last task executed, measured in the worker; "
                           "'incl start' is from worker spawn to last task executed")
        text, verdicts = render(bench.results, info, bench.notes)
        print(text, flush=True)
        if args.json:
            write_json(args.json, {"info": info, "results": bench.results, "targets": verdicts,
                                   "notes": bench.notes, "args": {
                                       k: (sorted(v) if isinstance(v, set) else v)
                                       for k, v in vars(args).items()}})
            log(f"wrote {args.json}")
        return 0
    finally:
        # Clients this process still holds would log their reconnect attempts.
        logging.getLogger("kazoo").setLevel(logging.CRITICAL)
        procs.stop_all()
        if zk is not None:
            zk.close()
        shutil.rmtree(work_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\ninterrupted; every process the benchmark started was stopped",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
