"""How long ``celery zk status`` and an exporter's scrape take on a big backlog.

Starts a ZooKeeper server with its default settings (a heap of ``--zk-heap``:
the whole tree lives in it; see docs/sizing.md), publishes a backlog of
Celery task messages (a no-op task with one argument, about 1 KB stored, the
default priority) into one queue and one message into two others, then times
a scrape of a running ``celery zk exporter`` (connection made: what each
Prometheus scrape costs, and the report's own part as the exporter says,
``celery_zk_scrape_duration_seconds``) and the whole ``celery zk status``
command (a new process: interpreter, Celery, connection and report).

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
import urllib.request

from celery import Celery
from common.processes import Processes, child_env, tail
from common.servers import close_sessions

from celery_zk.server import SERVER_JVM_FLAGS, ZooKeeperServer, free_ports
from celery_zk.transport import publish_together

BATCH = 5000   # messages per publish_together: 20 multis each
SCRAPE_DURATION = "celery_zk_scrape_duration_seconds "


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


def scrape(port: int) -> tuple[float, float, str]:
    """(seconds the scrape took, seconds of it the report took as the exporter
    says, the metrics)."""
    started = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as reply:
        body = reply.read().decode()
    took = time.perf_counter() - started
    own = next(line for line in body.splitlines() if line.startswith(SCRAPE_DURATION))
    return took, float(own[len(SCRAPE_DURATION):]), body


def scrapes(url: str, work: str, rounds: int, messages: int) -> list[tuple[float, float]]:
    """``rounds`` scrapes of a ``celery zk exporter`` on ``url``, after one uncounted
    that checks it counts the backlog."""
    port = free_ports(1)[0]
    procs = Processes()
    out = os.path.join(work, "exporter.out")
    proc = procs.spawn([sys.executable, "-m", "celery", "-b", url, "zk", "exporter",
                        "--port", str(port), "--addr", "127.0.0.1"], out, child_env())
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                body = scrape(port)[2]
                break
            except OSError:   # not listening yet
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the exporter did not start:\n{tail(out)}") from None
                time.sleep(0.2)
        line = f'celery_queue_length{{queue_name="backlog"}} {float(messages)}'
        assert line in body, f"the exporter did not count the {messages:,} messages"
        return [scrape(port)[:2] for _ in range(rounds)]
    finally:
        procs.stop_all()


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
            scraped = scrapes(url, work, args.rounds, args.messages)
            command = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                subprocess.run([sys.executable, "-m", "celery", "-b", url, "zk", "status"],
                               check=True, env=child_env(), capture_output=True, timeout=120)
                command.append(time.perf_counter() - started)
        except BaseException:
            print(f"ZooKeeper's log, last lines:\n{server.read_log(last_lines=30)}")
            raise
        finally:
            close_sessions(server.hosts)   # this process's, from the backlog's publishing
            server.close()
    for what, times in (("exporter scrape, warm", [took for took, _ in scraped]),
                        ("  of it the report (celery_zk_scrape_duration_seconds)",
                         [own for _, own in scraped]),
                        ("`celery zk status` command (new process)", command)):
        print(f"{what}, {args.rounds} rounds: median {statistics.median(times):.3f} s, "
              f"max {max(times):.3f} s")


if __name__ == "__main__":
    main()
