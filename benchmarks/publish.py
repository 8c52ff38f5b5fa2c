"""Publishing, side by side: ``apply_async`` rates and groups on zk, Redis and RabbitMQ.

One run starts its own ZooKeeper (server defaults, ``forceSync``, warmed up),
``redis-server`` (no persistence; ``redis-aof``: ``appendfsync always``, as
durable as ZooKeeper) and a private RabbitMQ node on free ports, and stops
everything it started, also on Ctrl-C. No worker runs: a publish is timed
until the broker has taken it.

  publish/s   ``apply_async`` of ``--publish`` no-op tasks from 1 and from 8
              threads of one process; zk confirmed (the default: each call
              returns once ZooKeeper stored the message) and with
              ``confirm_publish=false`` (timed until the last is stored);
  group       seconds to ``apply_async`` a group of 1,000 given as a list
              (zk stores it 256 per multi), and given as a generator (which
              Celery publishes as it yields);
  call        p50 / p99 ms of one ``apply_async`` call, one thread, calls
              paced apart; for zk and zk3 beside it the floor, a bare kazoo
              client's synced ``create`` of a 1 KB sequential node on the same
              server;
  bare/s      that create in a loop from one thread, as many as ``--publish``:
              the floor of a confirmed publish from one thread.

``zk3`` and ``rabbitmq3`` (:mod:`common.servers`): the replicated shape,
three members on hosts of their own, RabbitMQ's publishes confirmed.

Usage::

    .venv/bin/python benchmarks/publish.py [--quick] [--brokers zk,redis,redis-aof,rabbitmq]
        [--publish 2000] [--samples 200] [--zk-option KEY=VALUE] [--json out.json]
"""
from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import kombu.pools
from celery import group
from common.app import NOOP, make_app
from common.figures import log, percentile, sample, table, threaded_rate, write_json
from common.processes import bench_run
from common.servers import add_server_options, choose, start_servers
from kazoo.client import KazooClient

BROKERS = ("zk", "redis", "redis-aof", "rabbitmq", "zk3", "rabbitmq3")
DEFAULT_BROKERS = "zk,redis,redis-aof,rabbitmq"
GROUP_SIZE = 1000
COLUMNS = ["publish/s 1 thread", "publish/s 8 threads", "group of 1,000 s",
           "generator group s", "call ms", "bare create ms", "bare creates/s 1 thread"]


def stored(app: Any) -> None:
    """Close the app and kombu's pools: a connection closes only once everything it
    published unconfirmed is stored (``app.close()`` leaves the producer pool open)."""
    app.close()
    kombu.pools.reset()


def publish(url: str, count: int, threads: int) -> float:
    queue = f"publish-{uuid.uuid4().hex[:8]}"
    app = make_app(url)
    task = app.tasks[NOOP]
    task.apply_async((-1,), queue=queue)   # warm-up: connection, declaration
    return threaded_rate(lambda index: task.apply_async((index,), queue=queue), count,
                         threads, then=lambda: stored(app))


def call_ms(url: str, samples: int) -> list[float]:
    """Each ``apply_async`` call's milliseconds, one thread."""
    queue = f"publish-call-{uuid.uuid4().hex[:8]}"
    app = make_app(url)
    task = app.tasks[NOOP]
    try:
        return sample(lambda: timed(task.apply_async, (-1,), queue=queue), samples)
    finally:
        stored(app)


def bare_creates(hosts: str, samples: int, count: int) -> tuple[list[float], float]:
    """A bare kazoo client's synced ``create``: each of ``samples`` paced apart,
    milliseconds, and ``count`` in a loop, per second: the floor."""
    client = KazooClient(hosts)
    client.start()
    try:
        client.ensure_path("/bench-bare")

        def create() -> object:
            return client.create("/bench-bare/m-", b"x" * 1000, sequence=True)

        paced = sample(lambda: timed(create), samples)
        t0 = time.perf_counter()
        for _ in range(count):
            create()
        return paced, count / (time.perf_counter() - t0)
    finally:
        client.delete("/bench-bare", recursive=True)
        client.stop()
        client.close()


def timed(call: Callable[..., object], *args: object, **kwargs: object) -> float:
    t0 = time.perf_counter()
    call(*args, **kwargs)
    return time.perf_counter() - t0


def p50_p99(values: list[float]) -> str:
    return f"{percentile(values, 50):.2f} / {percentile(values, 99):.2f}"


def group_seconds(url: str, lazy: bool = False) -> float:
    """Seconds to apply a group of GROUP_SIZE given as a list, or (``lazy``) as a
    generator, which Celery publishes as it yields (no batching)."""
    queue = f"publish-group-{uuid.uuid4().hex[:8]}"
    app = make_app(url)
    noop = app.tasks[NOOP]
    noop.apply_async((-1,), queue=queue)
    t0 = time.perf_counter()
    sigs = (noop.s(i) for i in range(GROUP_SIZE))
    group(sigs if lazy else list(sigs)).apply_async(queue=queue)
    stored(app)
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with bench_run("celery-zk-publish-", args.keep) as (procs, work_dir, stops):
        servers = start_servers(args, procs, work_dir, stops, "publish")
        for name, server in servers.items():
            variants = [(name, server.url)]
            if name == "zk":
                sep = "&" if "?" in server.url else "?"
                variants.append(("zk unconfirmed", server.url + sep + "confirm_publish=false"))
            for label, url in variants:
                log(f"{label}: publish {args.publish}")
                results[label] = {
                    "publish/s 1 thread": publish(url, args.publish, 1),
                    "publish/s 8 threads": publish(url, args.publish, 8),
                    "group of 1,000 s": group_seconds(url),
                    "generator group s": group_seconds(url, lazy=True),
                    "call ms": p50_p99(call_ms(url, args.samples))}
                if server.zk is not None and label == name:
                    paced, rate = bare_creates(server.zk_hosts, args.samples, args.publish)
                    results[label].update({"bare create ms": p50_p99(paced),
                                           "bare creates/s 1 thread": rate})
    return results


def render(results: dict[str, Any]) -> str:
    rows = [["broker", *COLUMNS]]
    for name, row in results.items():
        rows.append([name, *("-" if k not in row else row[k] if k.endswith(" ms") else
                             f"{row[k]:.2f}" if k.endswith(" s") else f"{row[k]:,.0f}"
                             for k in COLUMNS)])
    return "\n".join(["Publishing (tasks/s; a group: seconds to publish it; "
                      "a call: p50 / p99 ms)", *table(rows)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default=DEFAULT_BROKERS,
                        help=f"some of {','.join(BROKERS)} (default {DEFAULT_BROKERS})")
    parser.add_argument("--publish", type=int, default=2000, help="tasks per rate measured")
    parser.add_argument("--samples", type=int, default=200, help="calls timed one by one")
    parser.add_argument("--quick", action="store_true", help="small sizes: checks every part")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    add_server_options(parser)
    args = parser.parse_args(argv)
    args.brokers = choose(parser, args.brokers, BROKERS)
    if args.quick:
        args.publish = 400
        args.samples = 20
        args.zk_warm_up = min(args.zk_warm_up, 2.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    print(render(results))
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
