"""What the storage budget costs a publish: ``apply_async`` with the budget
on (the default) and off (``budget_nodes=0&budget_bytes=0``), paired; with
``--what bytes``, what ``x-max-length-bytes`` (never reached) costs: a queue
with it ("on") against one without ("off"), both on a backlog of
``--backlog`` messages, never purged.

One ZooKeeper (ZooKeeper's defaults, production JVM flags, ``forceSync``),
one process, two Celery apps on the same server: blocks of ``--block``
publishes of a no-op task alternate on/off for ``--rounds`` rounds (the
order reversed each round), so the host's drift moves both alike. Prints
per round each side's publishes/s and p50/p99 of one ``apply_async``, and
the medians of the per-round ratios on ÷ off. The queue is purged between
rounds so both sides publish onto the same backlog.

    .venv/bin/python benchmarks/budget.py [--rounds 7] [--block 2000]
    .venv/bin/python benchmarks/budget.py --what bytes --backlog 20000
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from celery import Celery
from common.figures import percentile, table
from common.servers import (
    add_server_options,
    close_sessions,
    measured_server,
    warm_up_zookeeper,
)
from kombu import Queue

OFF = "budget_nodes=0&budget_bytes=0"


def block(app: Celery, count: int, queue: str = "budget") -> tuple[float, list[float]]:
    """``count`` publishes: their rate, and each one's seconds."""
    took = []
    with app.producer_or_acquire() as producer:
        started = time.perf_counter()
        for index in range(count):
            before = time.perf_counter()
            app.send_task("bench.noop", args=(index,), queue=queue, producer=producer)
            took.append(time.perf_counter() - before)
        return count / (time.perf_counter() - started), took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block", type=int, default=2000, help="publishes per side per round")
    parser.add_argument("--what", choices=["budget", "bytes"], default="budget")
    parser.add_argument("--backlog", type=int, default=0, help="--what bytes: waiting first")
    add_server_options(parser, started=False)
    args = parser.parse_args()
    with measured_server(args) as server:
        warm_up_zookeeper(server.hosts)
        apps = {"on": Celery("on", broker=f"{server.url}/budget", set_as_current=False),
                "off": Celery("off", broker=f"{server.url}/budget?{OFF}",
                              set_as_current=False)}
        queues = {"on": "budget", "off": "budget"}
        if args.what == "bytes":
            apps["off"] = apps["on"]
            queues = {"on": "bytes", "off": "plain"}
            apps["on"].conf.task_queues = [
                Queue("bytes", queue_arguments={"x-max-length-bytes": 1 << 40}), Queue("plain")]
        for side in ("on", "off"):   # warm: connections, the quota made, the JIT
            block(apps[side], 500 + args.backlog, queues[side])
        rows = [["round", "on /s", "off /s", "on p50 ms", "off p50 ms", "on p99 ms",
                 "off p99 ms"]]
        rate_ratio, p50_ratio = [], []
        for round_ in range(args.rounds):
            order = ["on", "off"] if round_ % 2 == 0 else ["off", "on"]
            got = {}
            for side in order:
                got[side] = block(apps[side], args.block, queues[side])
                if args.what == "budget":
                    with apps[side].connection_for_write() as conn:
                        conn.default_channel.queue_purge("budget")
            (on_rate, on), (off_rate, off) = got["on"], got["off"]
            rate_ratio.append(on_rate / off_rate)
            p50_ratio.append(statistics.median(on) / statistics.median(off))
            rows.append([str(round_ + 1), f"{on_rate:,.0f}", f"{off_rate:,.0f}",
                         f"{percentile(on, 50) * 1e3:.3f}", f"{percentile(off, 50) * 1e3:.3f}",
                         f"{percentile(on, 99) * 1e3:.3f}", f"{percentile(off, 99) * 1e3:.3f}"])
        print("\n".join(table(rows)))
        print(f"on ÷ off, median of the rounds: rate {statistics.median(rate_ratio):.3f} "
              f"(range {min(rate_ratio):.3f}-{max(rate_ratio):.3f}), p50 "
              f"{statistics.median(p50_ratio):.3f} (range {min(p50_ratio):.3f}-"
              f"{max(p50_ratio):.3f})")
        for app in set(apps.values()):
            app.close()
        close_sessions(server.hosts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
