"""Data-affinity scheduling: cache hit rate and throughput with and without it.

The shape of issue 17: ``--workers`` (4) ``celery worker`` processes (threads
pool, ``-c 1``: one task at a time, one cache each), ``--datasets`` (40)
datasets, and tasks that each need one dataset, chosen at random. A task
whose dataset is not in its worker's cache (an LRU of ``--cache`` (10))
sleeps ``--load-ms`` (50) to "load" it; every task then "works" on it for
``--work-ms`` (5).

Each run starts the workers on a fresh root of one ZooKeeper (celery_zk's
launcher, default settings), publishes ``--tasks`` (2,000) tasks as one
group (a backlog the workers drain as it lands) and times the drain from
the first publish until every task has run:

* ``plain``: no affinity key; the workers never state what they hold.
* ``affinity``: each task carries ``headers={'zk_affinity': dataset}``, and
  a task that loads a dataset states the cache's new contents with
  ``celery_zk.affinity.holding`` (``locality_wait`` at its default, 3 s).

The workers start with empty caches in both runs.

Then the price of a key on an idle queue, which keyed messages pay because
they are never handed straight to an idle consumer: one worker, and
``--latency-samples`` (200) tasks sent one at a time, from ``apply_async``
until the task body starts (a UDP datagram from the task), p50/p99 ms: no
key (handed off), a key this worker holds, and a key nobody holds.

Every process started is stopped, also on Ctrl-C.

Usage::

    .venv/bin/python benchmarks/affinity.py [--tasks 2000] [--pool threads|prefork]
        [--runs 1] [--latency-samples 200] [--json out.json]

This file is also the workers' Celery app (``celery -A affinity worker``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from functools import partial
from typing import Any

from celery import Celery, group
from common.figures import percentile, sample, write_json
from common.processes import Processes, child_env
from common.worker import start_workers

TASK = "affinity.process"
MARK = "affinity.mark"
HOLD = "affinity.hold"

# -- the workers' app -----------------------------------------------------------------
app = Celery("affinity", broker=os.environ.get("AFFINITY_BROKER", "memory://"),
             set_as_current=True)
app.conf.update(task_serializer="json", accept_content=["json"],
                worker_hijack_root_logger=False, broker_connection_retry_on_startup=True)


class _Cache:
    lock = threading.Lock()
    data: OrderedDict[str, bool] = OrderedDict()
    hits = misses = 0
    first = last = 0.0


@app.task(name=TASK, ignore_result=True)
def process(dataset: str) -> None:
    stats_file = os.environ["AFFINITY_STATS_FILE"]
    capacity = int(os.environ["AFFINITY_CACHE"])
    with _Cache.lock:   # -c 1 runs one at a time; the lock keeps the counts exact anyway
        cache = _Cache.data
        if dataset in cache:
            cache.move_to_end(dataset)
            _Cache.hits += 1
        else:
            time.sleep(float(os.environ["AFFINITY_LOAD_MS"]) / 1000)   # "load" it
            cache[dataset] = True
            while len(cache) > capacity:
                cache.popitem(last=False)
            _Cache.misses += 1
            if os.environ.get("AFFINITY_STATE") == "1":
                from celery_zk import affinity
                affinity.holding(cache, app=app)
        time.sleep(float(os.environ["AFFINITY_WORK_MS"]) / 1000)   # "work" on it
        now = time.time()
        _Cache.first = _Cache.first or now
        _Cache.last = now
        stats = {"hits": _Cache.hits, "misses": _Cache.misses,
                 "first": _Cache.first, "last": _Cache.last, "pid": os.getpid()}
    temp = f"{stats_file}.{os.getpid()}.tmp"
    with open(temp, "w") as fh:
        json.dump(stats, fh)
    os.replace(temp, f"{stats_file}.{os.getpid()}")


@app.task(name=MARK, ignore_result=True)
def mark(port: int, token: str) -> None:
    """Tell the client (a UDP datagram) when the task body started."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(f"{token} {time.monotonic()}".encode(), ("127.0.0.1", port))


@app.task(name=HOLD, ignore_result=True)
def hold(key: str) -> None:
    from celery_zk import affinity
    affinity.hold(key, app=app)


# -- the benchmark ----------------------------------------------------------------------
def _read_stats(work: str, run: str) -> list[dict[str, Any]]:
    found = []
    for name in os.listdir(work):
        if name.startswith(f"{run}.stats.") and not name.endswith(".tmp"):
            try:
                with open(os.path.join(work, name)) as fh:
                    found.append(json.load(fh))
            except (OSError, ValueError):
                pass   # being replaced: read again next time
    return found


def _start_workers(args: argparse.Namespace, url: str, work: str, run: str,
                   state: bool, count: int | None = None) -> Processes:
    env = child_env({"AFFINITY_BROKER": url,
                     "AFFINITY_STATS_FILE": os.path.join(work, f"{run}.stats"),
                     "AFFINITY_CACHE": str(args.cache), "AFFINITY_LOAD_MS": str(args.load_ms),
                     "AFFINITY_WORK_MS": str(args.work_ms),
                     "AFFINITY_STATE": "1" if state else "0"})
    names = [f"{run}{index}" for index in range(args.workers if count is None else count)]
    return start_workers("affinity", names, args.pool, 1, work, env)


def one_run(args: argparse.Namespace, hosts: str, work: str, run: str,
            with_affinity: bool) -> dict[str, Any]:
    url = f"zk://{hosts}/affinity-{run}"
    procs = _start_workers(args, url, work, run, state=with_affinity)
    client = Celery("client", broker=url, set_as_current=False)
    try:
        rng = random.Random(args.seed)
        datasets = [f"dataset-{rng.randrange(args.datasets)}" for _ in range(args.tasks)]
        signatures = []
        for dataset in datasets:
            options = {"headers": {"zk_affinity": dataset}} if with_affinity else {}
            signatures.append(client.signature(TASK, (dataset,), **options))
        started = time.time()
        group(signatures).apply_async()
        published = time.time() - started
        deadline = time.monotonic() + args.timeout
        while True:
            stats = _read_stats(work, run)
            done = sum(s["hits"] + s["misses"] for s in stats)
            if done >= args.tasks:
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.procs):
                raise SystemExit(f"{run}: {done} of {args.tasks} tasks ran before the "
                                 "timeout (or a worker exited); see the logs in " + work)
            time.sleep(0.05)
        hits = sum(s["hits"] for s in stats)
        elapsed = max(s["last"] for s in stats) - started
        per_worker = sorted(s["hits"] + s["misses"] for s in stats)
        return {"run": run, "affinity": with_affinity, "tasks": done,
                "hit_rate": round(hits / done, 3), "seconds": round(elapsed, 2),
                "tasks_per_s": round(done / elapsed, 1), "publish_s": round(published, 2),
                "per_worker": per_worker}
    finally:
        client.close()
        procs.stop_together(grace=20)


def _holds(client: Any, key: str) -> bool:
    """Whether a holding node of ``key`` exists (celery_zk.features.affinity.holding)."""
    from kazoo.exceptions import NoNodeError
    try:
        return any(name.startswith(f"{key}~") for shard in client.get_children("/affinity")
                   for name in client.get_children(f"/affinity/{shard}"))
    except NoNodeError:
        return False   # nothing held yet, or a shard made meanwhile


def latency(args: argparse.Namespace, hosts: str, work: str) -> dict[str, Any]:
    """Idle one-way p50/p99 ms, one worker: no key, a key it holds, one nobody holds."""
    from common.latency import oneway  # here: the workers import this module (common.app)
    from kazoo.client import KazooClient

    url = f"zk://{hosts}/affinity-latency"
    procs = _start_workers(args, url, work, "latency", state=False, count=1)
    client = Celery("client", broker=url, set_as_current=False)
    watcher = KazooClient(hosts=f"{hosts}/affinity-latency")
    watcher.start()
    try:
        client.send_task(HOLD, ("held",))
        deadline = time.monotonic() + 30
        while not _holds(watcher, "held"):
            if time.monotonic() > deadline:
                raise SystemExit("the worker never said it holds its key")
            time.sleep(0.05)
        out: dict[str, Any] = {}
        for case, key in (("no key", None), ("key held", "held"), ("key nobody holds", "nobody")):
            options = {"headers": {"zk_affinity": key}} if key else {}
            with oneway(partial(client.send_task, MARK, **options), []) as once:
                values = sample(once, args.latency_samples)
            out[case] = {"p50": round(percentile(values, 50), 2),
                         "p99": round(percentile(values, 99), 2)}
        return out
    finally:
        watcher.stop()
        watcher.close()
        client.close()
        procs.stop_together(grace=20)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--datasets", type=int, default=40)
    parser.add_argument("--cache", type=int, default=10)
    parser.add_argument("--load-ms", type=float, default=50.0)
    parser.add_argument("--work-ms", type=float, default=5.0)
    parser.add_argument("--pool", choices=("threads", "prefork"), default="threads")
    parser.add_argument("--runs", type=int, default=1, help="pairs of runs")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--latency-samples", type=int, default=200, help="0: skip")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    import kombu.pools

    from celery_zk.server import ZooKeeperServer

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    results = []
    with tempfile.TemporaryDirectory() as work, ZooKeeperServer() as zk:
        for index in range(args.runs):
            for with_affinity in (False, True):
                run = f"{'affinity' if with_affinity else 'plain'}{index}"
                result = one_run(args, zk.hosts, work, run, with_affinity)
                kombu.pools.reset()
                results.append(result)
                print(f"{run:>10}: hit rate {result['hit_rate']:.3f}, "
                      f"{result['tasks_per_s']:7.1f} tasks/s ({result['seconds']} s; "
                      f"publish {result['publish_s']} s; per worker "
                      f"{result['per_worker']})", flush=True)
        idle = latency(args, zk.hosts, work) if args.latency_samples else {}
    for index in range(args.runs):
        plain, aff = results[2 * index], results[2 * index + 1]
        print(f"pair {index}: hit rate {plain['hit_rate']:.3f} -> {aff['hit_rate']:.3f}, "
              f"throughput x{aff['tasks_per_s'] / plain['tasks_per_s']:.2f}")
    for case, value in idle.items():
        print(f"idle one-way, {case:>16}: p50 {value['p50']:.2f} ms, p99 {value['p99']:.2f} ms")
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results, "idle_latency": idle})
    return 0


if __name__ == "__main__":
    sys.exit(main())
