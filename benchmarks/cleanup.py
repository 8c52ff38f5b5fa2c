"""How long ``backend.cleanup()`` takes to delete a large expired hour of results.

Starts its own ZooKeeper (celery_zk's launcher, production JVM flags), stores
``--results`` results through the backend, then runs ``cleanup()`` with the
clock moved past ``result_expires`` and reports the time and rate. What the
number reflects: one listing of the expired hour, its 256 shard listings in
one pipelined round, and pipelined deletes of every result and index entry.

Usage: ``.venv/bin/python benchmarks/cleanup.py [--results 20000]``
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

from celery import Celery, states

import celery_zk  # noqa: F401  (registers zk://)
from celery_zk.server import SERVER_JVM_FLAGS, ZooKeeperServer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=int, default=20000)
    args = parser.parse_args()
    with ZooKeeperServer(jvm_flags=SERVER_JVM_FLAGS) as zk:
        app = Celery("cleanup-bench", broker="memory://", set_as_current=False,
                     backend=f"zk://{zk.hosts}/cleanup-bench")
        backend = app.backend
        try:
            started = time.monotonic()
            with ThreadPoolExecutor(8) as pool:  # filling is not what is measured
                list(pool.map(lambda i: backend.store_result(f"t{i}", i, states.SUCCESS),
                              range(args.results)))
            print(f"stored {args.results:,} results in {time.monotonic() - started:.1f} s")
            now = time.time()
            backend.clock = lambda: now + float(backend.expires) + 3600
            started = time.monotonic()
            backend.cleanup()
            elapsed = time.monotonic() - started
            assert app.AsyncResult(f"t{args.results - 1}").state == states.PENDING
            print(f"cleanup: {args.results:,} expired results deleted in {elapsed:.2f} s "
                  f"({args.results / elapsed:,.0f} results/s)")
        finally:
            backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
