"""How long an idle ``celery worker`` takes to exit after SIGTERM (warm shutdown).

Starts its own ZooKeeper (and ``redis-server`` for comparison, when Debian's
is installed), then for each pool starts an idle worker on ``zk://`` (and on
Redis), sends SIGTERM and times the exit. With ``--outage stopped`` the
broker's server is stopped 1 s before the SIGTERM (and started again after
the exit): a worker stopped during an outage::

    .venv/bin/python benchmarks/shutdown.py [--runs 3] [--pools threads,solo,prefork]
        [--outage none,stopped]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import REDIS_SERVER, Processes, RedisServer, spawn_worker  # noqa: E402

from celery_zk.server import ZooKeeperServer  # noqa: E402

#: Seconds a worker gets to exit before it counts as hung (and is killed).
PATIENCE = 60.0


def time_shutdown(broker: str, pool: str, work_dir: str, procs: Processes,
                  outage: Callable[[], None] | None = None) -> float:
    """Seconds from SIGTERM to exit of an idle worker that consumes from
    ``broker`` (``outage``: called 1 s before the SIGTERM); inf when it was
    still running after :data:`PATIENCE` s (then killed)."""
    proc = spawn_worker(procs, work_dir, f"shutdown-{time.monotonic_ns()}", broker,
                        "shutdown", pool=pool, concurrency=2)
    time.sleep(1.0)   # idle, waiting in drain_events
    if outage is not None:
        outage()
        time.sleep(1.0)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(PATIENCE)
        elapsed = time.monotonic() - started
    except subprocess.TimeoutExpired:
        elapsed = float("inf")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    procs.procs.remove(proc)
    return elapsed


def _stop_redis(server: RedisServer, procs: Processes) -> None:
    assert server.proc is not None
    server.proc.terminate()
    server.proc.wait(30)
    procs.procs.remove(server.proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pools", default="threads,solo,prefork")
    parser.add_argument("--outage", default="none",
                        help="none, stopped (the broker's server stopped before the SIGTERM)")
    args = parser.parse_args(argv)
    work_dir = tempfile.mkdtemp(prefix="celery-zk-shutdown-")
    procs = Processes()
    try:
        with ZooKeeperServer() as zk:
            zk.start()
            brokers = {"zk": f"{zk.url}/shutdown"}
            # How to stop each broker's server for one run, and start it again after.
            servers: dict[str, tuple[Callable[[], None], Callable[[], object]]] = {
                "zk": (zk.stop, zk.start)}
            if os.access(REDIS_SERVER, os.X_OK):
                redis = RedisServer(procs, work_dir).start()
                brokers["redis"] = redis.url(0)
                servers["redis"] = (lambda: _stop_redis(redis, procs), redis.start)
            for outage in args.outage.split(","):
                for pool in args.pools.split(","):
                    for name, broker in brokers.items():
                        stop, start = servers[name] if outage == "stopped" else (None, None)
                        times = []
                        for _ in range(args.runs):
                            times.append(time_shutdown(broker, pool, work_dir, procs, stop))
                            if start is not None:
                                start()
                        print(f"{outage:8s} {pool:8s} {name:6s} median "
                              f"{statistics.median(times):5.2f} s  "
                              f"({', '.join(f'{t:.2f}' for t in times)})", flush=True)
    finally:
        procs.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
