"""Latency and throughput in the shapes users run: celery_zk against Redis and RabbitMQ.

One run starts its own ZooKeeper (celery_zk's launcher, server defaults),
two ``redis-server`` (no persistence, and ``appendfsync always``: as durable
as ZooKeeper's fsync) and a private RabbitMQ node (durable queues, as Celery
declares them) on free ports, and stops everything it started, also on
Ctrl-C. Every worker is a real ``celery worker`` (threads pool, ``-c 4``, no
heartbeat, mingle or gossip).

Latency, p50/p99 ms, each shape idle and under a steady background load
(``--load`` tasks/s of a no-op task from another process, into the same
queue, the same worker):

  oneway     ``apply_async`` until the task body starts, seen through a side
             channel (a UDP datagram from the task). The task publishes
             nothing and has no result backend: what most tasks look like.
             Also reported: how long the ``apply_async`` call itself took
             (p50 and p99), the part of it before the message is stored.
  get        ``delay().get()`` with the broker's kind of result backend
             (zk: celery_zk's; Redis: Redis; RabbitMQ: ``rpc://``).
  roundtrip  the task publishes a reply on the broker and the client waits
             for it (``bench.py``'s (a)).

Throughput:

  drain      one 4-thread worker drains a backlog of ``--tasks`` no-op tasks
             (first to last task executed).
  publish    ``apply_async`` of ``--publish`` tasks from 1 and from 8 threads
             of one process, no worker; zk confirmed (default) and with
             ``confirm_publish=false`` (no publisher confirms, as RabbitMQ
             publishes by default).
  group      ``group(...).apply_async()`` of a 1,000-task group.

Usage::

    .venv/bin/python benchmarks/shapes.py [--quick] [--brokers zk,redis,redis-aof,rabbitmq]
        [--samples 200] [--load 200] [--only latency,drain,publish] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_app import DRAIN, MARK, NOOP, make_app  # noqa: E402
from bench_measure import reply_round_trip, result_round_trip  # noqa: E402
from celery import group  # noqa: E402
from common import (  # noqa: E402
    Processes,
    Workers,
    add_server_options,
    add_zk_option,
    bench_run,
    child_env,
    log,
    percentile,
    sample,
    start_brokers,
    table,
    tail,
    threaded_rate,
    write_json,
)

from celery_zk.broker.unconfirmed import flush_all  # noqa: E402

BROKERS = ("zk", "redis", "redis-aof", "rabbitmq")
SHAPES = ("oneway", "get", "roundtrip")
PARTS = ("latency", "drain", "publish")
GROUP_SIZE = 1000


# -- background load -----------------------------------------------------------------
def load_main(url: str, queue: str, rate: float, count_file: str = "") -> None:
    """The load process: ``rate`` no-op tasks per second into ``queue`` until
    killed; with ``count_file``, how many it has published so far is kept
    there (a machine too busy to keep up publishes fewer)."""
    app = make_app(url)
    noop = app.tasks[NOOP]
    start = time.monotonic()
    index = 0
    counter = os.open(count_file, os.O_WRONLY | os.O_CREAT, 0o644) if count_file else None
    while True:
        due = start + index / rate
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        noop.apply_async((index,), queue=queue)
        index += 1
        if counter is not None:
            os.pwrite(counter, b"%12d" % index, 0)


@contextmanager
def load(procs: Processes, work_dir: str, url: str, queue: str, rate: float,
         count_file: str = "") -> Iterator[subprocess.Popen[bytes] | None]:
    """The load process, publishing ``rate`` tasks/s (none if 0) while in the
    block (``count_file``: see :func:`load_main`)."""
    if rate <= 0:
        yield None
        return
    out = os.path.join(work_dir, f"load-{queue}.out")
    proc = procs.spawn([sys.executable, os.path.abspath(__file__), "--load-process", url,
                        queue, str(rate), count_file], out, child_env())
    try:
        time.sleep(2.0)   # connected and steady
        if proc.poll() is not None:
            raise RuntimeError(f"load process exited:\n{tail(out)}")
        yield proc
    finally:
        procs.stop_and_remove(proc)


def warm_up_with_load(procs: Processes, work_dir: str, url: str, seconds: float) -> None:
    """A worker under ``--load``'s steady load for ``seconds``, on a queue of its
    own. ZooKeeper's JVM compiles its request path with C2 for about half a
    minute of such a load (its C2 compiler thread took 0.4 of a core for 25 s,
    then nothing: ``benchmarks/README.md``, *A warm server*): measured before,
    zk pays for its server's start, which a server running for days has
    paid long ago. ``warm_up_zookeeper``'s few seconds of plain requests do
    not reach the multis with checks, the persistent watches' events or the
    multiReads."""
    if seconds <= 0:
        return
    log(f"warming up ZooKeeper with a worker under load for {seconds:.0f}s")
    queue = f"warm-up-{uuid.uuid4().hex[:8]}"
    with Workers(procs, work_dir, "warm-up-").worker(url, queue), \
            load(procs, work_dir, url, queue, 200.0):
        time.sleep(seconds)


# -- one broker --------------------------------------------------------------------------
class Broker:
    def __init__(self, name: str, url: str, backend: str, procs: Processes, work_dir: str,
                 args: argparse.Namespace) -> None:
        self.name, self.url, self.backend = name, url, backend
        self.procs, self.work_dir, self.args = procs, work_dir, args
        self.workers = Workers(procs, work_dir, f"{name}-")

    # -- latency --------------------------------------------------------------------
    def latency(self, samples: int, rate: float) -> dict[str, dict[str, float]]:
        queue = f"shapes-{uuid.uuid4().hex[:8]}"
        app = make_app(self.url, self.backend)
        out: dict[str, dict[str, float]] = {}
        publishes: list[float] = []
        with self.workers.worker(self.url, queue, backend=self.backend), \
                load(self.procs, self.work_dir, self.url, queue, rate):
            for shape, sampler in (
                    ("oneway", self._oneway(app, queue, publishes)),
                    ("get", result_round_trip(app, queue, self.name)),
                    ("roundtrip", reply_round_trip(app, self.url, queue, f"{queue}-reply"))):
                with sampler as once:
                    values = sample(once, samples)
                out[shape] = {"p50": percentile(values, 50), "p99": percentile(values, 99),
                              "n": samples}
        # How much of the one-way time the publishing call itself took (the
        # warm-up's calls left out): on zk the durable write it waits for.
        publishes = [seconds * 1000 for seconds in publishes[-samples:]]
        out["oneway"].update(publish_p50=percentile(publishes, 50),
                             publish_p99=percentile(publishes, 99))
        app.close()
        return out

    @contextmanager
    def _oneway(self, app: Any, queue: str, publishes: list[float]
                ) -> Iterator[Callable[[], float]]:
        mark = app.tasks[MARK]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", 0))
            sock.settimeout(30)
            port = sock.getsockname()[1]

            def once() -> float:
                token = uuid.uuid4().hex
                sent = time.monotonic()
                mark.apply_async((port, token), queue=queue)
                publishes.append(time.monotonic() - sent)
                while True:
                    got, started = sock.recv(200).decode().split()
                    if got == token:
                        return float(started) - sent
            yield once

    # -- throughput -----------------------------------------------------------------
    def drain(self, total: int) -> float:
        queue = f"shapes-drain-{uuid.uuid4().hex[:8]}"
        app = make_app(self.url)
        task = app.tasks[DRAIN]
        task.apply_async((-1,), queue=queue)   # declares the queue; not counted
        for index in range(total - 1):
            task.apply_async((index,), queue=queue)
        app.close()
        report, _ = self.workers.drain(self.url, queue, total, max(120.0, total / 20), self.name)
        return total / report["elapsed"]

    def publish(self, url: str, count: int, threads: int) -> float:
        queue = f"shapes-pub-{uuid.uuid4().hex[:8]}"
        app = make_app(url)
        task = app.tasks[NOOP]
        task.apply_async((-1,), queue=queue)   # warm-up: connection, declaration

        def stored() -> None:
            app.close()
            flush_all()   # unconfirmed: until the server stored every message (kombu's pool)

        return threaded_rate(lambda index: task.apply_async((index,), queue=queue), count,
                             threads, then=stored)

    def group(self, url: str, lazy: bool = False) -> float:
        """Seconds to apply a group of GROUP_SIZE given as a list, or (``lazy``)
        as a generator, which Celery publishes as it yields (no batching)."""
        queue = f"shapes-group-{uuid.uuid4().hex[:8]}"
        app = make_app(url)
        noop = app.tasks[NOOP]
        noop.apply_async((-1,), queue=queue)
        t0 = time.perf_counter()
        sigs = (noop.s(i) for i in range(GROUP_SIZE))
        group(sigs if lazy else list(sigs)).apply_async(queue=queue)
        app.close()
        flush_all()
        return time.perf_counter() - t0


# -- the run ---------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with bench_run("celery-zk-shapes-", args.keep) as (procs, work_dir, stack):
        urls, _ = start_brokers(args, procs, work_dir, stack, "shapes")
        if "zk" in urls:
            warm_up_with_load(procs, work_dir, urls["zk"][0], args.zk_warm_up)
        brokers = {name: Broker(name, *urls[name], procs, work_dir, args)
                   for name in args.brokers}
        if "latency" in args.only:
            for rate in (0.0, args.load):
                for name, broker in brokers.items():
                    label = "loaded" if rate else "idle"
                    log(f"{name}: latency, {label}")
                    for shape, figures in broker.latency(args.samples, rate).items():
                        results.setdefault(name, {})[f"{shape} {label}"] = figures
        if "drain" in args.only:
            for name, broker in brokers.items():
                log(f"{name}: drain {args.tasks}")
                results.setdefault(name, {})["drain/s"] = broker.drain(args.tasks)
        if "publish" in args.only:
            for name, broker in brokers.items():
                variants = [(name, broker.url)]
                if name == "zk":
                    sep = "&" if "?" in broker.url else "?"
                    variants.append(("zk unconfirmed", broker.url + sep + "confirm_publish=false"))
                for label, url in variants:
                    log(f"{label}: publish {args.publish}")
                    row = results.setdefault(label, {})
                    row["publish/s 1 thread"] = broker.publish(url, args.publish, 1)
                    row["publish/s 8 threads"] = broker.publish(url, args.publish, 8)
                    row["group of 1,000 s"] = broker.group(url)
                    row["generator group s"] = broker.group(url, lazy=True)
    return results


LATENCY = [f"{shape} {state}" for state in ("idle", "loaded") for shape in SHAPES]
THROUGHPUT = ["drain/s", "publish/s 1 thread", "publish/s 8 threads", "group of 1,000 s",
              "generator group s"]


def render(results: dict[str, Any], load_rate: float) -> str:
    out = [f"Latency p50 / p99 ms ('loaded': {load_rate:.0f} no-op tasks/s into the same queue)"]
    rows = [["broker", *LATENCY]]
    for name, row in results.items():
        if any(key in row for key in LATENCY):
            rows.append([name, *(f"{row[k]['p50']:.2f} / {row[k]['p99']:.2f}" if k in row
                                 else "-" for k in LATENCY)])
    zk = results.get("zk", {})
    for other in ("redis", "rabbitmq"):
        theirs = results.get(other, {})
        if zk and any(k in zk and k in theirs for k in LATENCY):
            rows.append([f"zk / {other}", *(
                f"{zk[k]['p50'] / theirs[k]['p50']:.2f} / {zk[k]['p99'] / theirs[k]['p99']:.2f}"
                if k in zk and k in theirs else "-" for k in LATENCY)])
    if len(rows) > 1:
        out += table(rows)
    calls = [f"{name} {state} {row[f'oneway {state}']['publish_p50']:.2f}"
             for name, row in results.items() for state in ("idle", "loaded")
             if "publish_p50" in row.get(f"oneway {state}", {})]
    if calls:
        out += ["oneway: p50 ms of it in apply_async itself (zk: it returns once the write "
                "is stored): " + ", ".join(calls)]
    rows = [["broker", *THROUGHPUT]]
    for name, row in results.items():
        if any(key in row for key in THROUGHPUT):
            rows.append([name, *(("-" if k not in row else f"{row[k]:.2f}" if k.endswith(" s")
                                  else f"{row[k]:,.0f}") for k in THROUGHPUT)])
    if len(rows) > 1:
        out += ["", "Throughput (tasks/s; the group: seconds to publish it)", *table(rows)]
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default=",".join(BROKERS))
    parser.add_argument("--only", default=",".join(PARTS))
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--load", type=float, default=200.0, help="background tasks/s")
    parser.add_argument("--tasks", type=int, default=5000, help="drain backlog")
    parser.add_argument("--publish", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="small sizes: checks every part")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    add_server_options(parser)
    add_zk_option(parser)
    args = parser.parse_args(argv)
    args.brokers = [b for b in args.brokers.split(",") if b]
    args.only = [p for p in args.only.split(",") if p]
    for name in args.brokers:
        if name not in BROKERS:
            parser.error(f"unknown broker {name!r}: choose from {', '.join(BROKERS)}")
    for part in args.only:
        if part not in PARTS:
            parser.error(f"unknown part {part!r}: choose from {', '.join(PARTS)}")
    if args.quick:
        args.samples, args.tasks, args.publish = 30, 1000, 400
        args.zk_warm_up = min(args.zk_warm_up, 2.0)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--load-process"]:
        load_main(argv[1], argv[2], float(argv[3]), *argv[4:5])
        return 0
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))   # clean up as on Ctrl-C
    results = run(args)
    print(render(results, args.load))
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
