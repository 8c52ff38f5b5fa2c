"""What kazoo's threads add to one synced request, idle and under a steady load.

A publish waits for one synced multi on ZooKeeper. Four clients in one
process take turns, each committing a multi of one create (then a delete,
untimed) on the same server (a multi, not kazoo's ``create``, whose result
kazoo completes through one more thread, its callback thread):

* ``queued``: celery_zk's client with kazoo's own request path: the caller
  queues the request and wakes kazoo's connection thread through a socket
  pair; that thread writes it, reads the reply and wakes the caller;
* ``direct``: the caller writes the request itself
  (:func:`celery_zk.compat.kazoo.direct_requests`); the connection thread
  still reads the reply and wakes the caller;
* ``reads``: celery_zk's client as it is made (``make_client``): the caller
  writes the request and, while it waits, reads the reply itself;
* ``raw``: a socket of its own, written and read by the caller alone (no
  thread at all): the floor of any client in Python.

"Loaded" runs a ``-P threads -c 4`` worker and ``--load`` no-op tasks per
second into its queue meanwhile (``shapes.py``'s load), as ``workers.py``'s
loaded latency does. The server's own time per write (its ``mntr``
``updatelatency``) is about the same idle and loaded; what grows under load
is the client's share.

Run from a directory that is no repository::

    .venv/bin/python <checkout>/benchmarks/client_hops.py [--samples 300] [--load 200]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import (  # noqa: E402
    Workers,
    add_server_options,
    bench_run,
    fmt,
    log,
    measured_server,
    percentile,
    table,
    write_json,
)
from kazoo.protocol.serialization import Create, Delete, Transaction  # noqa: E402
from kazoo.security import OPEN_ACL_UNSAFE  # noqa: E402
from request_cost import RawClient  # noqa: E402
from shapes import load, warm_up_with_load  # noqa: E402

from celery_zk.compat import kazoo as kazoo_compat  # noqa: E402
from celery_zk.zk.client import make_client  # noqa: E402
from celery_zk.zk.config import parse_url  # noqa: E402

PAYLOAD = b"x" * 600
CLIENTS = ("queued", "direct", "reads", "raw")


def measure(hosts: str, root: str, samples: int) -> dict[str, list[float]]:
    """``samples`` synced creates per client, taking turns, in ms."""
    settings = parse_url(f"zk://{hosts}")
    with mock.patch.object(kazoo_compat, "direct_requests", lambda client: False):
        queued = make_client(settings)
    direct = make_client(settings)
    direct._call.__self__.reads = None   # its connection thread reads every reply
    reads = make_client(settings)
    raw = RawClient(hosts)
    queued.ensure_path(root)
    kazoos = {"queued": queued, "direct": direct, "reads": reads}
    times: dict[str, list[float]] = {name: [] for name in CLIENTS}
    try:
        for i in range(samples):
            for name in CLIENTS:
                path = f"{root}/{name}-{i}"
                time.sleep(0.03)
                start = time.monotonic()
                if name == "raw":
                    raw.call(Transaction([Create(path, PAYLOAD, OPEN_ACL_UNSAFE, 0)]))
                else:
                    txn = kazoos[name].transaction()
                    txn.create(path, PAYLOAD)
                    txn.commit()
                times[name].append((time.monotonic() - start) * 1000)
                if name == "raw":
                    raw.call(Delete(path, -1))   # type: ignore[arg-type]
                else:
                    direct.delete(path)
        assert direct._call.__self__.led == 0 and reads._call.__self__.led >= samples // 2
    finally:
        raw.close()
        for client in kazoos.values():
            client.stop()
            client.close()
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with bench_run("client-hops-") as (procs, work_dir, stack):
        server = measured_server(args)
        server.start()
        stack.append(server.stop)
        url = f"zk://{server.hosts}/bench"
        warm_up_with_load(procs, work_dir, url, args.zk_warm_up)
        for rate in (0.0, args.load) * args.rounds:
            label = "idle" if rate == 0 else "loaded"
            queue = f"hops-{label}-{len(results)}"
            log(f"{label}: {args.samples} creates per client")
            with Workers(procs, work_dir, f"hops-{len(results)}-").worker(url, queue), \
                    load(procs, work_dir, url, queue, rate):
                times = measure(server.hosts, f"/hops-{len(results)}", args.samples)
            results[f"{label}-{len(results)}"] = {
                name: {"p50": percentile(values, 50), "p90": percentile(values, 90),
                       "p99": percentile(values, 99)} for name, values in times.items()}
    return results


def render(results: dict[str, Any]) -> str:
    rows = [["round", *(f"{name} p50 / p90 / p99" for name in CLIENTS)]]
    for label, by_client in results.items():
        rows.append([label, *(" / ".join(fmt(by_client[name][p], 2) for p in ("p50", "p90", "p99"))
                              for name in CLIENTS)])
    return "\n".join(["Synced multi of one create, ms (client-side)", *table(rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_server_options(parser)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--load", type=float, default=200.0, help="background tasks/s")
    parser.add_argument("--rounds", type=int, default=2, help="idle/loaded pairs")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    results = run(args)
    print(render(results))
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
