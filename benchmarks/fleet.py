"""Past one machine, by simulation: many lean consumers on one queue, or on many.

Celery's worker costs a host a process per pool; the broker's side of many
hosts is their consumers. Here each consumer is a kombu consumer of its own
(a thread with its own ``Connection``, prefetch ``--prefetch``), ``--per-process``
of them in a process (one ZooKeeper session each, as celery_zk keeps one per
process): 16, 64, 256, 1,024 consumers on one queue of ``--tasks`` stored
messages, started together at a gate; with ``--queues Q``, consumer ``j``
and message ``i`` on queue ``j % Q`` and ``i % Q``, a dispatcher for each.
Each message is acked as it arrives; no Celery, no task runs, so what is
measured is the queues' side: their rate, the dispatchers' CPU per
assignment (the thread that gives a queue's work, in whichever consumer
process its election chose, read from its thread CPU clock), and ZooKeeper's
logged transactions, requests and packets sent per message.

Usage::

    .venv/bin/python benchmarks/fleet.py [--brokers zk3] [--consumers 16,64,256,1024]
        [--per-process 32] [--tasks 20000] [--prefetch 4] [--queues 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from common import txnlog
from common.app import waiting
from common.figures import log, table, write_json
from common.processes import Processes, bench_run, child_env
from common.servers import Server, add_server_options, choose, start_server
from common.tally import Tally, record

BROKERS = ("zk3", "zk")


def consume(url: str, base: str, queues: int, first: int, count: int, prefetch: int,
            tally: str, gate: str, done: str, out: str) -> None:
    """A consumer process: consumers ``first`` .. ``first + count - 1`` from the
    gate on, then (once ``done`` exists) the CPU seconds of the dispatcher threads
    that ran here to ``out``."""
    from kombu import Connection, Queue

    import celery_zk  # noqa: F401  (registers zk://)

    def on_message(body: Any, message: Any) -> None:
        record(tally, int(body))
        message.ack()

    connected = threading.Semaphore(0)

    def one(queue: str) -> None:
        with Connection(url) as conn:
            conn.connect()   # the session before the gate
            connected.release()
            while not os.path.exists(gate):
                time.sleep(0.01)
            with conn.Consumer(Queue(queue), callbacks=[on_message], accept=["json"]) as cons:
                cons.qos(prefetch_count=prefetch)
                while True:
                    try:
                        conn.drain_events(timeout=1)
                    except socket.timeout:
                        pass

    for j in range(first, first + count):
        threading.Thread(target=one, args=(f"{base}-{j % queues}",), daemon=True).start()
    for _ in range(count):
        connected.acquire()
    open(out + ".ready", "w").close()
    while not os.path.exists(done):
        time.sleep(0.05)
    cpu = [time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
           for thread in threading.enumerate()
           if thread.name.startswith(f"celery_zk-dispatch-{base}-")
           and thread.ident is not None]
    with open(out, "w") as fh:
        json.dump({"dispatcher_cpu_s": cpu}, fh)
    os._exit(0)   # 32 sessions closing one by one would only slow the next drain


def store(url: str, base: str, queues: int, total: int) -> None:
    """``total`` messages (their index as the body; message ``i`` on queue ``i % queues``),
    pipelined, stored before a consumer."""
    from kombu import Connection, Queue
    names = [f"{base}-{q}" for q in range(queues)]
    with Connection(url, transport_options={"confirm_publish": False}) as conn:
        producer = conn.Producer(serializer="json")
        for index in range(total):
            name = names[index % queues]
            producer.publish(index, routing_key=name,
                             declare=[Queue(name)] if index < queues else [])
    deadline = time.monotonic() + 300
    while sum(waiting(url, name) for name in names) < total:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base}: not all {total} messages stored")
        time.sleep(0.2)


def drain(server: Server, args: argparse.Namespace, work_dir: str, consumers: int
          ) -> dict[str, Any]:
    queue = f"fleet-{consumers}-{uuid.uuid4().hex[:6]}"
    url = server.url.split("?")[0]
    log(f"{server.name}: {consumers} consumers: store {args.tasks:,} on {args.queues} queue(s)")
    store(url, queue, args.queues, args.tasks)
    tag = os.path.join(work_dir, queue)
    tally = Tally(f"{tag}.tally", args.tasks)
    gate, done = f"{tag}.gate", f"{tag}.done"
    processes = math.ceil(consumers / args.per_process)
    group = Processes()
    outs = [f"{tag}-{i}.json" for i in range(processes)]
    try:
        for i, out in enumerate(outs):
            count = min(args.per_process, consumers - i * args.per_process)
            group.spawn([sys.executable, __file__, "--consume", url, queue, str(args.queues),
                         str(i * args.per_process), str(count), str(args.prefetch),
                         tally.path, gate, done, out], f"{tag}-{i}.out",
                        child_env())
        deadline = time.monotonic() + 300   # every process imported, every consumer connected
        while not all(os.path.exists(out + ".ready") for out in outs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{queue}: consumers not connected in 300 s")
            time.sleep(0.05)
        before, packets = server.zxid(), server.client_packets()
        log(f"{server.name}: {consumers} consumers in {processes} processes: go")
        opened = time.monotonic()
        open(gate, "w").close()
        while not tally.done():
            if time.monotonic() - opened > 600:
                raise RuntimeError(f"{queue}: not drained in 600 s")
            time.sleep(0.01)
        summary = tally.summary()
        after, packets_after = server.zxid(), server.client_packets()
        open(done, "w").close()
        deadline = time.monotonic() + 60
        while not all(os.path.exists(out) for out in outs) and time.monotonic() < deadline:
            time.sleep(0.05)
        found = [json.load(open(out))["dispatcher_cpu_s"] for out in outs
                 if os.path.exists(out)]
    finally:
        group.stop_together()
        tally.close()
    assert server.zk is not None
    counts = txnlog.count(server.zk.data_dir, before, after)
    cpu = [value for values in found for value in values]
    entry = {"consumers": consumers, "queues": args.queues, "processes": processes,
             "tasks": args.tasks,
             "rate": args.tasks / (summary.last - summary.first),
             "first_after_gate_s": summary.first - opened,
             "dispatcher_cpu_ms_per_message": sum(cpu) * 1000 / args.tasks if cpu else None,
             "dispatchers_seen": len(cpu),
             "txns_per_message": counts.transactions / args.tasks,
             "failed_per_message": counts.failed / args.tasks,
             "requests_per_message": (packets_after[0] - packets[0]) / args.tasks,
             "packets_sent_per_message": (packets_after[1] - packets[1]) / args.tasks}
    log(f"{server.name}: {consumers} consumers: {entry['rate']:,.0f} messages/s")
    return entry


COLUMNS = (("messages/s", "rate", ",.0f"), ("dispatcher CPU ms/msg",
                                            "dispatcher_cpu_ms_per_message", ".3f"),
           ("txns/msg", "txns_per_message", ".3f"), ("failed/msg", "failed_per_message", ".3f"),
           ("requests/msg", "requests_per_message", ".2f"),
           ("packets sent/msg", "packets_sent_per_message", ".2f"))


def render(results: dict[str, list[dict[str, Any]]]) -> str:
    rows = [["broker", "consumers", "queues", *(head for head, _, _ in COLUMNS)]]
    for name, entries in results.items():
        for entry in entries:
            rows.append([name, f"{entry['consumers']:,}", str(entry["queues"]), *(
                "-" if entry[key] is None else format(entry[key], spec)
                for _, key, spec in COLUMNS)])
    return "\n".join(["N lean consumers (acked on arrival, no Celery)", *table(rows)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default="zk3", help=f"some of {','.join(BROKERS)}")
    parser.add_argument("--consumers", default="16,64,256,1024")
    parser.add_argument("--per-process", type=int, default=32)
    parser.add_argument("--tasks", type=int, default=20000)
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--queues", type=int, default=1, help="queues the consumers share out")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    add_server_options(parser)
    args = parser.parse_args(argv)
    args.brokers = choose(parser, args.brokers, BROKERS)
    args.consumers = [int(n) for n in args.consumers.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--consume"]:
        url, base, queues, first, count, prefetch, tally, gate, done, out = argv[1:]
        consume(url, base, int(queues), int(first), int(count), int(prefetch), tally, gate,
                done, out)
        return 0
    args = parse_args(argv)
    results: dict[str, list[dict[str, Any]]] = {}
    with bench_run("celery-zk-fleet-", args.keep) as (procs, work_dir, stops):
        for name in args.brokers:
            server = start_server(name, args, procs, work_dir, stops, "fleet")
            results[name] = [drain(server, args, work_dir, n) for n in args.consumers]
            stops.remove(server.stop)
            server.stop()
    print(render(results))
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
