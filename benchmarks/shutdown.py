"""How long an idle ``celery worker`` takes to exit after SIGTERM (warm shutdown).

Starts its own ZooKeeper (and ``redis-server`` for comparison, when Debian's
is installed), then for each pool starts an idle worker on ``zk://`` (and on
Redis), sends SIGTERM and times the exit::

    .venv/bin/python benchmarks/shutdown.py [--runs 3] [--pools threads,solo,prefork]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import REDIS_SERVER, Processes, RedisServer, spawn_worker  # noqa: E402

from celery_zk.server import ZooKeeperServer  # noqa: E402


def time_shutdown(broker: str, pool: str, work_dir: str, procs: Processes) -> float:
    """Seconds from SIGTERM to exit of an idle worker that consumes from ``broker``."""
    proc = spawn_worker(procs, work_dir, f"shutdown-{time.monotonic_ns()}", broker,
                        "shutdown", pool=pool, concurrency=2)
    time.sleep(1.0)   # idle, waiting in drain_events
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    elapsed = time.monotonic() - started
    procs.procs.remove(proc)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pools", default="threads,solo,prefork")
    args = parser.parse_args(argv)
    work_dir = tempfile.mkdtemp(prefix="celery-zk-shutdown-")
    procs = Processes()
    try:
        with ZooKeeperServer() as zk:
            zk.start()
            brokers = {"zk": f"{zk.url}/shutdown"}
            if os.access(REDIS_SERVER, os.X_OK):
                brokers["redis"] = RedisServer(procs, work_dir).start().url(0)
            for pool in args.pools.split(","):
                for name, broker in brokers.items():
                    times = [time_shutdown(broker, pool, work_dir, procs)
                             for _ in range(args.runs)]
                    print(f"{pool:8s} {name:6s} median {statistics.median(times):5.2f} s  "
                          f"({', '.join(f'{t:.2f}' for t in times)})", flush=True)
    finally:
        procs.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
