"""Celery's remote control on each broker: ``app.control.ping`` and what it costs ZooKeeper.

A remote-control call (``celery inspect``, ``celery control``, Flower's
polling) declares a reply queue, binds and consumes it, broadcasts the
command, and deletes the queue once the replies are in (kombu's
``after_reply_message_received``); kombu's ``Mailbox`` names the queue after
the mailbox bound for the call, so every call makes a new one. This script
times ``app.control.ping(limit=1)`` against one idle ``-P threads -c 4``
worker on each broker and, on zk, counts the server's transactions per call
from its log (the caller's and the worker's together), by kind.

Usage (from a directory that is no repository, as for ``workers.py``)::

    .venv/bin/python benchmarks/control.py [--brokers zk,rabbitmq,redis]
        [--calls 100] [--json out.json]
"""
from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

import txnlog
from bench_app import make_app
from common import (
    Workers,
    add_server_options,
    add_zk_option,
    bench_run,
    log,
    percentile,
    start_brokers,
    write_json,
)

BROKERS = ("zk", "rabbitmq", "redis")


def ping_calls(url: str, calls: int, workers: Workers) -> list[float]:
    """Milliseconds of ``calls`` pings, each answered by the one worker."""
    queue = f"control-{uuid.uuid4().hex[:8]}"
    with workers.worker(url, queue):
        app = make_app(url)
        try:
            for _ in range(5):   # connections, the worker's first replies
                app.control.ping(timeout=5, limit=1)
            values = []
            for _ in range(calls):
                started = time.perf_counter()
                replies = app.control.ping(timeout=5, limit=1)
                values.append((time.perf_counter() - started) * 1000)
                if not replies:
                    raise RuntimeError(f"{url}: a ping got no reply within 5 s")
                time.sleep(0.02)
            return values
        finally:
            app.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with bench_run("celery-zk-control-") as (procs, work_dir, stack):
        urls, zk = start_brokers(args, procs, work_dir, stack, "control")
        for name in args.brokers:
            workers = Workers(procs, work_dir, f"{name}-")
            before = txnlog.last_zxid(zk.host, zk.port) if name == "zk" and zk else 0
            log(f"{name}: {args.calls} pings")
            values = ping_calls(urls[name][0], args.calls, workers)
            row: dict[str, Any] = {"ping_p50_ms": percentile(values, 50),
                                   "ping_p99_ms": percentile(values, 99)}
            if name == "zk" and zk:
                # The window holds the warm-up's pings and the worker's start and
                # stop too: counted per call, those are a few hundredths.
                counts = txnlog.count(zk.data_dir, before, txnlog.last_zxid(zk.host, zk.port))
                calls = args.calls + 5
                row["transactions_per_call"] = counts.transactions / calls
                row["per_call_by_kind"] = {kind: round(n / calls, 2)
                                           for kind, n in sorted(counts.kinds.items())}
                row["failed_transactions"] = counts.errors   # in all, by kind and code
            results[name] = row
    return results


def render(results: dict[str, Any]) -> str:
    out = ["app.control.ping(limit=1), one idle worker: p50 / p99 ms"]
    for name, row in results.items():
        line = f"  {name:10} {row['ping_p50_ms']:7.2f} / {row['ping_p99_ms']:7.2f}"
        if "transactions_per_call" in row:
            kinds = ", ".join(f"{kind} {n}" for kind, n in row["per_call_by_kind"].items())
            line += (f"   ZooKeeper transactions per call: "
                     f"{row['transactions_per_call']:.1f} ({kinds})")
            if row["failed_transactions"]:
                line += f"; failed in all: {row['failed_transactions']}"
        out.append(line)
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default="zk,rabbitmq",
                        help=f"comma-separated, of {', '.join(BROKERS)} (default zk,rabbitmq)")
    parser.add_argument("--calls", type=int, default=100, help="pings per broker (100)")
    parser.add_argument("--json", help="write the figures here too")
    add_server_options(parser)
    add_zk_option(parser)
    args = parser.parse_args()
    args.brokers = [b for b in args.brokers.split(",") if b]
    unknown = set(args.brokers) - set(BROKERS)
    if unknown:
        parser.error(f"unknown broker(s) {', '.join(sorted(unknown))}; "
                     f"choose from {', '.join(BROKERS)}")
    results = run(args)
    print(render(results))
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
