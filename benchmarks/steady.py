"""CPU per task under a steady load, process by process, on each broker.

``workers.py``'s loaded latency shapes run their probes while another
process publishes ``--load`` no-op tasks per second into the worker's queue
(``shapes.py``'s load process). A broker whose delivery costs much CPU at
that rate leaves the probe waiting for a core, not for the broker: on a
2-core machine the load alone can fill it. This script runs only that
load, with the same worker (``-P threads -c 4``, or ``--pool prefork``),
for ``--seconds`` after a settling second, and reports the CPU each process
spent per task (ms): the worker (with its pool children), the load
publisher, the broker's server, and the machine's whole busy time::

    .venv/bin/python benchmarks/steady.py [--brokers zk,redis,rabbitmq]
        [--rates 100,200] [--seconds 15] [--pool threads] [--zk-option KEY=VALUE]

The tasks counted are those the worker ran within the window (``bench.noop``
tasks publish nothing; the worker's tally of them is read from its log of
task starts: ``BENCH_COUNT_FILE``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import txnlog  # noqa: E402
from common import (  # noqa: E402
    Workers,
    add_server_options,
    add_zk_option,
    bench_run,
    fmt,
    log,
    start_brokers,
    table,
    write_json,
)
from machine import busy_jiffies, process_jiffies, run_pids  # noqa: E402
from shapes import load, warm_up_with_load  # noqa: E402

from celery_zk.server import four_letter_word  # noqa: E402

BROKERS = ("zk", "redis", "rabbitmq")
CLK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def server_pids(name: str, procs: Any, zk: Any) -> list[int]:
    """The broker's server and what runs in its process group (RabbitMQ's beam)."""
    if name == "zk":
        leaders = [zk.pid]
    else:
        wanted = "redis-server" if name.startswith("redis") else "rabbitmq-server"
        leaders = [proc.pid for proc in procs.procs
                   if os.path.basename(str(proc.args[0])) == wanted]
    return run_pids(leaders, leaders)


def measure(name: str, url: str, procs: Any, work_dir: str, workers: Workers, zk: Any,
            rate: float, seconds: float, pool: str) -> dict[str, float]:
    queue = f"steady-{uuid.uuid4().hex[:8]}"
    count_file = os.path.join(work_dir, f"{queue}.count")
    with workers.worker(url, queue, pool=pool) as (worker, _), \
            load(procs, work_dir, url, queue, rate, count_file) as publisher:
        time.sleep(1.0)   # steady: load() waited 2 s for its connection already
        groups = {"worker": run_pids([worker.pid], [worker.pid]),
                  "publisher": [publisher.pid] if publisher is not None else [],
                  "server": server_pids(name, procs, zk)}
        before = {role: process_jiffies(pids) for role, pids in groups.items()}
        zxid = txnlog.last_zxid(zk.host, zk.port) if name == "zk" else 0
        packets = received(zk) if name == "zk" else 0
        machine, began, wall = busy_jiffies(), time.monotonic(), time.time()
        published = published_so_far(count_file)
        time.sleep(seconds)
        elapsed = time.monotonic() - began
        published = published_so_far(count_file) - published
        after = {role: process_jiffies(pids) for role, pids in groups.items()}
        machine = busy_jiffies() - machine
        if name == "zk":
            packets = received(zk) - packets
            counts = txnlog.count(zk.data_dir, zxid, txnlog.last_zxid(zk.host, zk.port))
    tasks = published   # what the load process managed, at most rate * elapsed
    out: dict[str, Any] = {f"{role} ms": (after[role] - before[role]) * CLK_MS / tasks
                           for role in groups}
    out["machine ms"] = machine * CLK_MS / tasks
    out["machine cores"] = machine * CLK_MS / 1000 / elapsed
    out["tasks/s"] = published / elapsed
    out["window"] = [wall, wall + elapsed]   # time.time(), for probes in the processes
    if name == "zk":
        out["requests"] = packets / tasks
        out["transactions"] = counts.transactions / tasks
        out["by type"] = {kind: round(n / tasks, 3) for kind, n in sorted(counts.kinds.items())}
    return out


def published_so_far(count_file: str) -> int:
    with open(count_file, "rb") as fh:
        return int(fh.read() or b"0")


def received(zk: Any) -> int:
    """Packets the server has received (``mntr``: every request and ping)."""
    reply = four_letter_word(zk.host, zk.port, "mntr", timeout=10)
    for line in reply.splitlines():
        key, _, value = line.partition("\t")
        if key == "zk_packets_received":
            return int(value)
    raise RuntimeError(f"no zk_packets_received in mntr's reply: {reply!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default=",".join(BROKERS))
    parser.add_argument("--rates", default="200")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--pool", default="threads")
    parser.add_argument("--json", help="also write the results here")
    add_server_options(parser)
    add_zk_option(parser)
    args = parser.parse_args(argv)
    args.brokers = args.brokers.split(",")
    rates = [float(r) for r in args.rates.split(",")]
    results: dict[str, Any] = {}
    with bench_run("celery-zk-steady-") as (procs, work_dir, stack):
        urls, zk = start_brokers(args, procs, work_dir, stack, "steady")
        if "zk" in urls:
            warm_up_with_load(procs, work_dir, urls["zk"][0], args.zk_warm_up)
        for rate in rates:
            for name in args.brokers:
                log(f"{name}: {rate:.0f} tasks/s for {args.seconds:.0f} s")
                figures = measure(name, urls[name][0], procs, work_dir,
                                  Workers(procs, work_dir, f"{name}-"), zk, rate,
                                  args.seconds, args.pool)
                results.setdefault(name, {})[str(rate)] = figures
    columns = ["tasks/s", "worker ms", "publisher ms", "server ms", "machine ms", "machine cores",
               "requests", "transactions"]
    rows = [["broker", "asked", *columns]]
    for name, by_rate in results.items():
        for rate, figures in by_rate.items():
            rows.append([name, rate, *(fmt(figures[c], 2) if c in figures else "-"
                                       for c in columns)])
    print("\n".join(table(rows)))
    for name, by_rate in results.items():
        for rate, figures in by_rate.items():
            if "by type" in figures:
                print(f"{name} at {rate} tasks/s, transactions per task by type: "
                      f"{figures['by type']}")
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
