"""Where an idle round trip over ``zk://`` spends its time, step by step.

The same round trip as ``bench.py``'s (a) (one ``bench.echo`` task at a time
to an idle ``celery worker``, which replies on the broker), with timestamps
taken in both processes at the transport's steps. ``time.perf_counter`` is
``CLOCK_MONOTONIC`` on Linux, so the two processes' clocks agree. Prints, for
each step, its median offset from the client's ``apply_async`` call and the
median gap since the step before::

    .venv/bin/python benchmarks/timeline.py [--samples 150] [--result] [--zk-force-sync yes|no]
        [--zk-option handoff=false]

``--result``: the result round trip instead (``bench.py``'s (d): ``bench.add``
with celery_zk's result backend, ``delay(...).get()``).

The hooks wrap celery_zk methods from the outside (``marks.py``); this
is a diagnostic, not a benchmark with targets.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_app import ADD, ECHO, make_app  # noqa: E402
from common import (  # noqa: E402
    Processes,
    Workers,
    add_server_options,
    add_zk_option,
    measured_server,
    pause,
    warm_up_zookeeper,
)
from kombu import Connection, Queue  # noqa: E402
from marks import ENV_FILE, dump, install, mark  # noqa: E402

#: (role, step) in the order a round trip passes them; the table follows it. Not
#: the returns of writes: the watch event of a write often reaches the other
#: process before the writer has read its reply.
STEPS = [
    ("client", "apply_async", "the client calls apply_async"),
    ("client", "put", "kombu hands the message to the transport"),
    ("client", "give", "a hand-off to an idle consumer's offer is tried"),
    ("client", "write", "its multi is written to the socket"),
    ("client", "sent", "... and is on its way: the socket took it"),
    ("worker", "dispatch", "(put in line) the dispatcher's multi starts"),
    ("worker", "tree", "the worker's inbox watch reports it"),
    ("worker", "get", "the worker's consuming thread is running"),
    ("worker", "learn", "it looks at its inbox's arrivals"),
    ("worker", "read", "... and has sent their reads"),
    ("worker", "take", "the body is read; delivered to kombu"),
    ("worker", "task", "the task starts"),
    ("worker", "put", "the task publishes its reply"),
    ("client", "tree", "the client's inbox watch reports the reply"),
    ("client", "get", "the client's consuming thread is running"),
    ("client", "learn", "it looks at its inbox's arrivals"),
    ("client", "read", "... and has sent their reads"),
    ("client", "take", "the body is read; delivered to kombu"),
    ("client", "reply", "the reply reaches the client's callback"),
]

#: The result round trip (--result): the reply is a done node, not a message.
RESULT_STEPS = STEPS[:STEPS.index(("worker", "task", "the task starts")) + 1] + [
    ("worker", "store", "the backend writes the done node"),
    ("worker", "stored-result", "the done node is written"),
    ("client", "watch", "the client's watch on the done node fires"),
    ("client", "got", "get() returns the result"),
]

#: Marks taken as a write returns, after its request has left: the other process
#: may pass its next step before the writer's thread, preempted on a busy
#: machine, takes the mark. The step after one is looked for from the step
#: before it (the write's start), else it is missed for a later one (a CI run
#: saw a trip's inbox watch report taken before its ``sent``: the next report
#: found was the ack's, after every later step of the trip).
AFTER_THE_WRITE = {("client", "sent"), ("worker", "stored-result")}


def timeline(path: str, warm_up: int, steps: list[tuple[str, str, str]] = STEPS
             ) -> list[tuple[str, str, str, float, float, int]]:
    """Per step: (role, step, meaning, median offset ms, median gap ms, trips seen)."""
    rows: list[tuple[float, str, str]] = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            stamp, role, step = line.split()
            rows.append((float(stamp), role, step))
    rows.sort()
    trips: list[dict[tuple[str, str], list[float]]] = []
    for ts, role, step in rows:
        if (role, step) == ("client", "apply_async"):
            trips.append(defaultdict(list))
        if trips:
            trips[-1][(role, step)].append(ts)
    offsets: dict[tuple[str, str], list[float]] = defaultdict(list)
    gaps: dict[tuple[str, str], list[float]] = defaultdict(list)
    for trip in trips[warm_up:]:
        start = previous = since = trip[steps[0][:2]][0]
        for role, step, _ in steps:
            key = (role, step)
            # The first time the step is passed after the step before it (a
            # consuming thread also runs _get before the message is there).
            passed = next((ts for ts in trip.get(key, ()) if ts >= since), None)
            if passed is None:
                continue
            offsets[key].append((passed - start) * 1000)
            gaps[key].append((passed - previous) * 1000)
            if key not in AFTER_THE_WRITE:
                since = passed
            previous = passed
    return [(role, step, meaning,
             statistics.median(offsets[(role, step)]) if offsets[(role, step)] else float("nan"),
             statistics.median(gaps[(role, step)]) if gaps[(role, step)] else 0.0,
             len(offsets[(role, step)]))
            for role, step, meaning in steps]


def record(args: argparse.Namespace, warm_up: int) -> str:
    """Run the round trips with the hooks in place; returns the marks file."""
    work_dir = tempfile.mkdtemp(prefix="celery-zk-timeline-")
    path = os.path.join(work_dir, "marks.txt")
    procs = Processes()
    install()
    try:
        with measured_server(args) as zk:
            zk.start()
            warm_up_zookeeper(zk.hosts)
            query = "?" + "&".join(args.zk_option) if args.zk_option else ""
            url = f"zk://{zk.hosts}/timeline-{uuid.uuid4().hex[:8]}{query}"
            workers = Workers(procs, work_dir)
            if args.result:
                backend = f"zk://{zk.hosts}/timeline-results-{uuid.uuid4().hex[:8]}{query}"
                app = make_app(url, backend)
                add = app.tasks[ADD]
                with workers.worker(url, "timeline", backend=backend, env={ENV_FILE: path}):
                    for _ in range(args.samples + warm_up):
                        pause()
                        mark("apply_async")
                        add.apply_async((1, 2), queue="timeline").get(timeout=30)
                        mark("got")
                app.close()
                dump(path, "client")
                return path
            app = make_app(url)
            echo = app.tasks[ECHO]
            got: list[str] = []

            def on_reply(body: dict[str, str], message: Any) -> None:
                mark("reply")
                got.append(body["token"])
                message.ack()

            with Connection(url) as conn, workers.worker(url, "timeline", env={ENV_FILE: path}):
                with conn.Consumer(Queue("timeline-reply", durable=False), accept=["json"],
                                   callbacks=[on_reply]):
                    for _ in range(args.samples + warm_up):
                        pause()
                        token = uuid.uuid4().hex
                        mark("apply_async")
                        echo.apply_async(("timeline-reply", token), queue="timeline")
                        deadline = time.monotonic() + 30
                        while token not in got:
                            conn.drain_events(timeout=max(0.01, deadline - time.monotonic()))
                        got.clear()
            app.close()   # the worker has stopped and written its marks
            dump(path, "client")
    finally:
        procs.stop_all()
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=150)
    parser.add_argument("--result", action="store_true",
                        help="time the result round trip (delay().get()) instead")
    add_server_options(parser)
    add_zk_option(parser)
    args = parser.parse_args(argv)
    warm_up = 5
    path = record(args, warm_up)
    print(f"median over {args.samples} round trips (ms; offset from apply_async, gap from "
          f"the step before)\n")
    print(f"{'process':8s} {'step':12s} {'offset':>7s} {'gap':>6s}  n     meaning")
    steps = RESULT_STEPS if args.result else STEPS
    for role, step, meaning, offset, gap, count in timeline(path, warm_up, steps):
        print(f"{role:8s} {step:12s} {offset:7.2f} {gap:6.2f}  {count:<5d} {meaning}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
