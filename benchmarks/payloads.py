"""Big payloads: publish and round-trip times, 100 KB to 15 MB, zk against Redis and RabbitMQ.

One run starts its own ZooKeeper (production JVM flags, server defaults: 1 MiB
``jute.maxbuffer``), a ``redis-server`` (no persistence) and a private
RabbitMQ node (durable queues, as Celery declares them; 3.x takes messages up
to 128 MiB) on free ports, and stops everything it started, also on Ctrl-C.
Each broker has its own kind of result backend (zk: celery_zk's; Redis:
Redis; RabbitMQ: ``rpc://``) and one real worker (threads pool, ``-c 4``).
For each payload size (a str of that many characters, JSON):

  publish      ``apply_async`` of a task whose argument is the payload, to a
               queue no worker consumes: until the broker has stored it.
  round trip   ``apply_async((payload,)).get()`` of a task that returns its
               argument: the payload goes to the worker and comes back.
  result       ``apply_async((size,)).get()`` of a task that returns that many
               bytes: a small message and a big result (celery_zk stores a
               result above ``chunk_size`` in chunks).

Then the ZooKeeper server's live heap after a full GC, every result
forgotten: what the server still holds of recent writes (its last 500
proposals, whatever their size; see docs/sizing.md).

Every figure is the median of the samples (``--samples``, fewer for the big
sizes: at most about 60 MB moved per cell), after two uncounted ones. A cell
whose payload the broker refuses says so instead of a figure (on zk, one above
``max_message_size``: ``MessageTooLarge``).

Usage::

    .venv/bin/python benchmarks/payloads.py [--brokers zk,redis,rabbitmq]
        [--sizes 100000,1000000,4000000,15000000] [--samples 20] [--json out.json]
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from common.app import IDENTITY, MAKE, NOOP, make_app
from common.figures import log, sample, table, write_json
from common.processes import Processes, bench_run
from common.servers import add_server_options, choose, heap_used, start_servers
from common.worker import Workers

from celery_zk.exceptions import MessageTooLarge

BROKERS = ("zk", "redis", "rabbitmq")
SIZES = (100_000, 1_000_000, 4_000_000, 15_000_000)
MEASURES = ("publish", "round trip", "result")
#: Bytes moved per cell at most (a 15 MB cell takes 4 samples, a 100 KB one all).
CELL_BYTES = 60_000_000
WARM_UP = 2
TIMEOUT = 120.0


def samples_for(size: int, samples: int) -> int:
    return max(3, min(samples, CELL_BYTES // size))


def label(size: int) -> str:
    return f"{size // 1_000_000} MB" if size >= 1_000_000 else f"{size // 1000} KB"


def measure(once: Callable[[], float], count: int) -> dict[str, Any]:
    """Median and spread of ``count`` samples (ms), or why the broker refused."""
    try:
        values = sample(once, count, warm_up=WARM_UP)
    except MessageTooLarge as exc:
        reason = re.sub(r" for queue '[^']*'", "", str(exc).split(";")[0])
        return {"refused": f"{type(exc).__name__}: {reason}"}
    return {"p50": statistics.median(values), "min": min(values), "max": max(values),
            "n": count}


class Broker:
    def __init__(self, name: str, url: str, backend: str, procs: Processes,
                 work_dir: str) -> None:
        self.name, self.url, self.backend = name, url, backend
        self.workers = Workers(procs, work_dir, f"{name}-")

    def run(self, sizes: list[int], samples: int) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        app = make_app(self.url, self.backend)
        try:
            for size in sizes:
                log(f"{self.name}: publish {label(size)}")
                out.setdefault("publish", {})[label(size)] = self.publish(app, size, samples)
            queue = f"payloads-{uuid.uuid4().hex[:8]}"
            with self.workers.worker(self.url, queue, backend=self.backend):
                for size in sizes:
                    log(f"{self.name}: round trip and result {label(size)}")
                    count = samples_for(size, samples)
                    out.setdefault("round trip", {})[label(size)] = measure(
                        self._round_trip(app, queue, IDENTITY, "x" * size, size), count)
                    out.setdefault("result", {})[label(size)] = measure(
                        self._round_trip(app, queue, MAKE, size, size), count)
        finally:
            app.close()
        return out

    def publish(self, app: Any, size: int, samples: int) -> dict[str, Any]:
        queue = f"payloads-pub-{uuid.uuid4().hex[:8]}"
        task = app.tasks[IDENTITY]
        app.tasks[NOOP].apply_async((0,), queue=queue)   # connection, declaration
        payload = "x" * size

        def once() -> float:
            t0 = time.perf_counter()
            task.apply_async((payload,), queue=queue)
            return time.perf_counter() - t0

        try:
            return measure(once, samples_for(size, samples))
        finally:
            with app.connection_for_write() as conn:   # nothing consumes it
                conn.default_channel.queue_purge(queue)

    def _round_trip(self, app: Any, queue: str, name: str, argument: Any,
                    size: int) -> Callable[[], float]:
        task = app.tasks[name]

        def once() -> float:
            t0 = time.perf_counter()
            result = task.apply_async((argument,), queue=queue)
            value = result.get(timeout=TIMEOUT)
            elapsed = time.perf_counter() - t0
            if len(value) != size:
                raise RuntimeError(f"{self.name}: {name} returned {len(value)} bytes, "
                                   f"not {size}")
            result.forget()   # keep the servers' memory for the next sample
            return elapsed
        return once


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with bench_run("celery-zk-payloads-", args.keep) as (procs, work_dir, stops):
        servers = start_servers(args, procs, work_dir, stops, "payloads")
        for name, server in servers.items():
            broker = Broker(name, server.url, server.backend, procs, work_dir)
            results[name] = broker.run(args.sizes, args.samples)
            if server.zk is not None and server.zk.pid:
                # Every result was forgotten: what is left is ZooKeeper's own
                # memory of recent writes (its last 500 proposals).
                results["zk heap MB"] = heap_used(server.zk.pid) / 2**20
    return results


def cell(figures: dict[str, Any] | None) -> str:
    if figures is None:
        return "-"
    if "refused" in figures:
        return "not supported (MessageTooLarge)"
    return f"{figures['p50']:,.1f} ({figures['min']:,.1f}-{figures['max']:,.1f}, n={figures['n']})"


def render(results: dict[str, Any], sizes: list[int]) -> str:
    labels = [label(size) for size in sizes]
    rows = [["broker", "measure", *labels]]
    for name, measures in results.items():
        if not isinstance(measures, dict):
            continue
        for measure_name in MEASURES:
            row = measures.get(measure_name, {})
            rows.append([name, measure_name, *(cell(row.get(lab)) for lab in labels)])
    refused = [f"{name} {measure_name} {lab}: {figures['refused']}"
               for name, measures in results.items() if isinstance(measures, dict)
               for measure_name, row in measures.items() for lab, figures in row.items()
               if "refused" in figures]
    out = ["Median ms (min-max, samples)", *table(rows)]
    if "zk heap MB" in results:
        out += ["", f"ZooKeeper live heap after the run, every result forgotten: "
                    f"{results['zk heap MB']:,.0f} MB"]
    if refused:
        out += ["", "Refused, e.g. " + refused[0]]
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default=",".join(BROKERS))
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="payload sizes in bytes, comma-separated")
    parser.add_argument("--samples", type=int, default=20,
                        help="samples per cell (fewer for big sizes: ~60 MB per cell)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    add_server_options(parser)
    args = parser.parse_args(argv)
    args.brokers = choose(parser, args.brokers, BROKERS)
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    print(render(results, args.sizes))
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
