"""How long ``celery zk status`` takes on a big backlog (issue: under 2 s at 100,000).

Starts a ZooKeeper server with its default settings (a heap of ``--zk-heap``:
the whole tree lives in it; see docs/sizing.md), publishes a backlog of
Celery task messages (a no-op task with one argument, about 1 KB stored, the
default priority) into one queue and one message into two others, then
times :func:`celery_zk.ops.status.collect` in this process (warm: connection
made) and the whole ``celery zk status`` command (a new process:
interpreter, Celery, connection and report).

    .venv/bin/python benchmarks/status.py [--messages 100000] [--rounds 5] [--zk-heap 2g]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from celery import Celery  # noqa: E402

from celery_zk.broker.groups import publish_together  # noqa: E402
from celery_zk.ops.status import collect  # noqa: E402
from celery_zk.server import SERVER_JVM_FLAGS, ZooKeeperServer  # noqa: E402

BATCH = 5000   # messages per publish_together: 20 multis each


def fill(url: str, messages: int) -> float:
    """Publish the backlog; seconds it took."""
    app = Celery("status-bench", broker=url, set_as_current=False)
    started = time.perf_counter()
    with app.producer_or_acquire() as producer:
        for first in range(0, messages, BATCH):
            with publish_together():
                for index in range(first, min(first + BATCH, messages)):
                    app.send_task("bench.noop", args=(index,), queue="backlog",
                                  producer=producer)
        for queue in ("small-a", "small-b"):
            app.send_task("bench.noop", args=(0,), queue=queue, producer=producer)
    took = time.perf_counter() - started
    app.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--zk-heap", default="2g", help="the server's -Xmx")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        heap = f"-Xmx{args.zk_heap}"
        server = ZooKeeperServer(data_dir=os.path.join(work, "zk"), jvm_flags=(
            heap, *(flag for flag in SERVER_JVM_FLAGS if not flag.startswith("-Xm"))))
        server.start()
        try:
            url = f"{server.url}/status-bench"
            print(f"publishing {args.messages:,} messages ...", flush=True)
            print(f"  published in {fill(url, args.messages):.1f} s")
            app = Celery("status-bench", broker=url, set_as_current=False)
            with app.connection_for_write() as conn:
                conn.connect()
                transport = conn.transport
                times = []
                for _ in range(args.rounds):
                    started = time.perf_counter()
                    report = collect(transport.handle.client, transport.layout,
                                     transport.settings.hosts)
                    times.append(time.perf_counter() - started)
            app.close()
            backlog = next(q for q in report.queues if q.name == "backlog")
            assert backlog.waiting_total == args.messages, backlog
            env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(
                os.path.abspath(__file__)))}
            command = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                subprocess.run([sys.executable, "-m", "celery", "-b", url, "zk", "status"],
                               check=True, env=env, capture_output=True, timeout=120)
                command.append(time.perf_counter() - started)
        except BaseException:
            print(f"ZooKeeper's log, last lines:\n{server.read_log(last_lines=30)}")
            raise
        finally:
            server.close()
    print(f"status report (collect), warm, {args.rounds} rounds: median "
          f"{statistics.median(times):.3f} s, max {max(times):.3f} s")
    print(f"`celery zk status` command (new process), {args.rounds} rounds: median "
          f"{statistics.median(command):.3f} s, max {max(command):.3f} s")


if __name__ == "__main__":
    main()
