"""Cluster-wide limits (issue 29): does a limit hold across workers, and what
does it cost the tasks it does not limit?

``--workers`` (4) ``celery worker`` processes (``--pool``, threads by default,
``-c 2`` each) consume one queue that holds two tasks: ``limits.paced``
(``--limited`` (300) of them, 10 ms each) and ``limits.free`` (``--free``
(3,000), no work), published interleaved as one backlog. Every task appends
its start and end time to a log. Runs, each on a fresh root:

* ``zk none``: no limit: the free tasks' drain rate without limits.
* ``zk rate``: ``zk_rate_limits = {"limits.paced": "--rate" (20/s)}``: the
  most paced tasks started in any 1 s window (the limit is 20), their mean
  rate, and the free tasks' drain rate (the limit must not hold them up).
* ``zk concurrency``: ``zk_concurrency_limits = {"limits.paced": 3}``, paced
  tasks that take 200 ms and ack late: the most running at once (8 pool
  slots; the limit is 3) and the drain time (at best limited x 0.2 / 3 s).
* ``redis celery-rate``: the same rate as Celery's own ``rate_limit`` (per
  worker instance) on Redis: what the limit comes to with 4 workers.

ZooKeeper with default settings (celery_zk's launcher) and redis-server on a
free port, both started and stopped by the script.

Usage::

    .venv/bin/python benchmarks/limits.py [--pool prefork] [--json out.json]

This file is also the workers' Celery app (``celery -A limits worker``).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from typing import Any

from celery import Celery
from common.figures import write_json
from common.processes import Processes, child_env
from common.servers import RedisServer
from common.spans import most_at_once, most_in_any_window
from common.worker import start_workers

PACED, FREE = "limits.paced", "limits.free"

# -- the workers' app ------------------------------------------------------------------
app = Celery("limits", broker=os.environ.get("LIMITS_BROKER", "memory://"),
             set_as_current=True)
app.conf.update(task_serializer="json", accept_content=["json"],
                worker_hijack_root_logger=False, broker_connection_retry_on_startup=True,
                **json.loads(os.environ.get("LIMITS_CONF", "{}")))


def _record(kind: str, start: float) -> None:
    line = f"{kind} {start:.6f} {time.time():.6f}\n".encode()
    fd = os.open(os.environ["LIMITS_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)   # one write with O_APPEND: lines never interleave
    finally:
        os.close(fd)


@app.task(name=PACED, ignore_result=True, acks_late=True)
def paced(seconds: float) -> None:
    start = time.time()
    time.sleep(seconds)
    _record("paced", start)


@app.task(name=FREE, ignore_result=True)
def free() -> None:
    _record("free", time.time())


# -- the benchmark ---------------------------------------------------------------------
def _read(path: str) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {"paced": [], "free": []}
    try:
        with open(path) as fh:
            for line in fh:
                kind, start, end = line.split()
                out[kind].append((float(start), float(end)))
    except FileNotFoundError:
        pass
    return out


def _wait_for_limits(hosts: str, root: str, deadline: float) -> None:
    """Until a worker has written the app's limits (at worker_ready)."""
    from kazoo.client import KazooClient
    client = KazooClient(hosts=hosts)
    client.start()
    try:
        while not client.exists(f"/{root}/limits") or not client.get_children(f"/{root}/limits"):
            if time.monotonic() > deadline:
                raise SystemExit("no worker wrote the limits")
            time.sleep(0.1)
    finally:
        client.stop()
        client.close()


def one_run(args: argparse.Namespace, name: str, broker: str, conf: dict[str, Any],
            work: str, paced_seconds: float, zk_hosts: str | None = None,
            root: str | None = None) -> dict[str, Any]:
    log_path = os.path.join(work, f"{name.replace(' ', '-')}.log")
    env = child_env({"LIMITS_BROKER": broker, "LIMITS_LOG": log_path,
                     "LIMITS_CONF": json.dumps(conf)})
    procs = start_workers("limits", [f"w{index}" for index in range(args.workers)], args.pool,
                          args.concurrency, work, env)
    client = Celery("client", broker=broker, set_as_current=False)
    try:
        if zk_hosts and (conf.get("zk_rate_limits") or conf.get("zk_concurrency_limits")):
            _wait_for_limits(zk_hosts, root or "", time.monotonic() + 90)
        per = max(1, args.free // args.limited)
        started = time.time()
        with client.producer_or_acquire() as producer:
            for _ in range(args.limited):
                client.send_task(PACED, (paced_seconds,), producer=producer)
                for _free in range(per):
                    client.send_task(FREE, producer=producer)
        published = time.time() - started
        total = args.limited * (1 + per)
        deadline = time.monotonic() + args.timeout
        while True:
            got = _read(log_path)
            if len(got["paced"]) + len(got["free"]) >= total:
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.procs):
                raise SystemExit(f"{name}: {len(got['paced'])} paced and {len(got['free'])} "
                                 f"free of {total} ran before the timeout; logs in {work}")
            time.sleep(0.1)
        paced_starts = [s for s, _ in got["paced"]]
        free_ends = [e for _, e in got["free"]]
        paced_span = max(paced_starts) - min(paced_starts)
        return {
            "run": name, "published_s": round(published, 2),
            "free_tasks_per_s": round(len(free_ends) / (max(free_ends) - started), 1),
            "free_drain_s": round(max(free_ends) - started, 2),
            "paced_most_in_1s": most_in_any_window(paced_starts, 1.0),
            "paced_mean_per_s": round((len(paced_starts) - 1) / paced_span, 1)
            if paced_span else None,
            "paced_most_at_once": most_at_once(got["paced"]),
            "paced_drain_s": round(max(e for _, e in got["paced"]) - started, 2),
        }
    finally:
        client.close()
        procs.stop_together(grace=20)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2, help="-c of each worker")
    parser.add_argument("--pool", choices=("threads", "prefork"), default="threads")
    parser.add_argument("--limited", type=int, default=300)
    parser.add_argument("--free", type=int, default=3000)
    parser.add_argument("--rate", default="20/s")
    parser.add_argument("--max-concurrency", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    import kombu.pools

    from celery_zk.server import ZooKeeperServer

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    results = []
    servers = Processes()
    try:
        with tempfile.TemporaryDirectory() as work, ZooKeeperServer() as zk:
            redis = RedisServer(servers, work).start()
            runs: list[tuple[str, str, dict[str, Any], float, str | None]] = [
                ("zk none", f"{zk.url}/none", {}, 0.01, "none"),
                ("zk rate", f"{zk.url}/rate", {"zk_rate_limits": {PACED: args.rate}},
                 0.01, "rate"),
                ("zk concurrency", f"{zk.url}/conc",
                 {"zk_concurrency_limits": {PACED: args.max_concurrency}}, 0.2, "conc"),
                ("redis celery-rate", redis.url(0),
                 {"task_annotations": {PACED: {"rate_limit": args.rate}}}, 0.01, None),
            ]
            for name, broker, conf, seconds, root in runs:
                result = one_run(args, name, broker, conf, work, seconds,
                                 zk.hosts if root else None, root)
                kombu.pools.reset()
                results.append(result)
                print(f"{name:>18}: free {result['free_tasks_per_s']:7.1f} tasks/s; paced: "
                      f"most in 1 s {result['paced_most_in_1s']}, mean "
                      f"{result['paced_mean_per_s']}/s, most at once "
                      f"{result['paced_most_at_once']}, drained in "
                      f"{result['paced_drain_s']} s", flush=True)
    finally:
        servers.stop_all()
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
