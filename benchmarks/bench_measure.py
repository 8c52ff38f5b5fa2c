"""bench.py's measurements: how each is taken against one broker.

(a) the idle-worker round trip over the broker alone, (b) the drain of a
backlog, (c) publish rounds, (d) the result round trip and (e) the floor
(``floor.py``'s bare ZooKeeper requests). The samplers of (a) and (d) are
``shapes.py``'s ``roundtrip`` and ``get`` shapes too.
"""
from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from bench_app import ADD, DRAIN, ECHO, make_app
from celery import Celery
from common import Processes, Workers, log, percentile, sample
from floor import measure as measure_floor
from kombu import Connection, Queue

BROKERS = ("zk", "redis", "kombu-zk")
FLOOR = "zk-floor"   # the row of (e): bare ZooKeeper requests, no Celery
UNCONFIRMED = "zk-unconfirmed"   # (c) again with confirm_publish=false (an opt-in)
PUBLISH_ROUNDS = 4   # even: see the alternating order in Bench.publish_rounds()
FLOOR_MODES = ("handoff", "result-handoff", "claim", "claim-listing", "get-delete", "result",
               "split")


# -- samplers: each once() is one sample, in seconds ----------------------------------------
@contextmanager
def reply_round_trip(app: Celery, url: str, queue: str, reply: str
                     ) -> Iterator[Callable[[], float]]:
    """One ``bench.echo`` task; the client waits for the reply the task publishes to
    ``reply`` on the same broker (no result backend)."""
    echo = app.tasks[ECHO]
    got: list[str] = []

    def on_reply(body: dict[str, str], message: Any) -> None:
        got.append(body["token"])   # the sample ends here; the ack is not timed
        message.ack()

    with Connection(url) as conn, conn.Consumer(
            Queue(reply, routing_key=reply, durable=False), accept=["json"],
            callbacks=[on_reply]):
        def once() -> float:
            token = uuid.uuid4().hex
            t0 = time.perf_counter()
            echo.apply_async((reply, token), queue=queue)
            deadline = time.monotonic() + 30
            while token not in got:
                conn.drain_events(timeout=max(0.01, deadline - time.monotonic()))
            elapsed = time.perf_counter() - t0
            got.clear()
            return elapsed
        yield once


@contextmanager
def result_round_trip(app: Celery, queue: str, label: str) -> Iterator[Callable[[], float]]:
    """``bench.add.apply_async((i, 1)).get()`` with the app's result backend."""
    add = app.tasks[ADD]
    counter = iter(range(10**9))

    def once() -> float:
        i = next(counter)
        t0 = time.perf_counter()
        result = add.apply_async((i, 1), queue=queue)
        value = result.get(timeout=30)
        elapsed = time.perf_counter() - t0
        if value != i + 1:
            raise RuntimeError(f"{label}: add({i}, 1) returned {value!r}")
        result.forget()
        return elapsed
    yield once


@dataclass
class Bench:
    """Shared state of one run: servers, work dir, options, results."""

    args: argparse.Namespace
    procs: Processes
    work_dir: str
    urls: dict[str, str] = field(default_factory=dict)
    backends: dict[str, str] = field(default_factory=dict)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workers = Workers(self.procs, self.work_dir)

    # -- (a) round trip over the broker alone ----------------------------------------
    def latency(self, name: str, samples: int) -> dict[str, Any]:
        url = self.urls[name]
        run = uuid.uuid4().hex[:8]
        queue, reply = f"bench-lat-{run}", f"bench-reply-{run}"
        app = make_app(url)
        with self.workers.worker(url, queue), reply_round_trip(app, url, queue, reply) as once:
            values = sample(once, samples)
        app.close()
        return {"latency_p50": percentile(values, 50), "latency_p99": percentile(values, 99),
                "latency_mean": statistics.fmean(values), "latency_samples": samples}

    # -- (b) backlog drain -------------------------------------------------------------
    def drain(self, name: str, total: int) -> dict[str, Any]:
        url = self.urls[name]
        queue = f"bench-drain-{uuid.uuid4().hex[:8]}"
        app = make_app(url)
        task = app.tasks[DRAIN]
        task.apply_async((-1,), queue=queue)  # declares the queue; not counted
        t0 = time.perf_counter()
        for index in range(total - 1):
            task.apply_async((index,), queue=queue)
        backlog_publish = (total - 1) / (time.perf_counter() - t0)
        app.close()
        report, spawned = self.workers.drain(url, queue, total, max(120.0, total / 20), name)
        return {
            "drain_rate": total / report["elapsed"],
            "drain_rate_incl_startup": total / (report["last"] - spawned),
            "drain_tasks": total, "drain_seconds": report["elapsed"],
            "drain_duplicates": report["executions"] - report["distinct"],
            "backlog_publish_rate": backlog_publish,
        }

    # -- (c) publish ---------------------------------------------------------------------
    def publish(self, name: str, count: int) -> dict[str, Any]:
        url = self.urls[name]
        queue = f"bench-pub-{uuid.uuid4().hex[:8]}"
        app = make_app(url)
        task = app.tasks[DRAIN]
        task.apply_async((-1,), queue=queue)  # warm-up: connection, queue declaration
        t0 = time.perf_counter()
        for index in range(count):
            task.apply_async((index,), queue=queue)
        if name == UNCONFIRMED:
            app.close()  # waits until ZooKeeper stored every message: that time counts
        elapsed = time.perf_counter() - t0
        app.close()
        return {"publish_rate": count / elapsed, "publish_count": count}

    def publish_rounds(self, selected: list[str], query: str) -> None:
        """(c) for every selected broker (and zk unconfirmed): interleaved rounds, the
        median, so no broker gets a warmer server by its position."""
        publishers = list(selected)
        if "zk" in selected:
            self.urls[UNCONFIRMED] = (self.urls["zk"] + ("&" if query else "?")
                                      + "confirm_publish=false")
            publishers.append(UNCONFIRMED)
            self.notes.append(
                f"{UNCONFIRMED}: publish only, with the opt-in transport option "
                "confirm_publish=false (pipelined; in-flight messages are lost if the "
                "process is killed). The publish target uses the default, zk")
        count = self.args.publish
        rates: dict[str, list[float]] = {name: [] for name in publishers}
        for round_ in range(PUBLISH_ROUNDS):
            # Every other round in reverse: each broker goes first equally often.
            for name in publishers if round_ % 2 == 0 else publishers[::-1]:
                log(f"{name}: (c) publish {count} tasks, round {round_ + 1}")
                rates[name].append(self.publish(name, count)["publish_rate"])
        for name in publishers:
            self.results.setdefault(name, {}).update(
                publish_rate=statistics.median(rates[name]), publish_count=count,
                publish_rounds=[round(r, 1) for r in rates[name]])

    # -- (d) result round trip -------------------------------------------------------------
    def result(self, name: str, samples: int) -> dict[str, Any]:
        url, backend = self.urls[name], self.backends[name]
        queue = f"bench-res-{uuid.uuid4().hex[:8]}"
        app = make_app(url, backend)
        with self.workers.worker(url, queue, backend=backend), \
                result_round_trip(app, queue, name) as once:
            values = sample(once, samples)
        app.close()
        return {"result_p50": percentile(values, 50), "result_p99": percentile(values, 99),
                "result_samples": samples}

    # -- (e) floor -------------------------------------------------------------------------
    def floor(self, hosts: str, samples: int) -> None:
        """The bare ZooKeeper requests of (a) and (d) in every floor.py mode: the
        ``zk-floor`` row and a note with the modes that have no column."""
        floor: dict[str, list[float]] = {}
        for mode in FLOOR_MODES:
            log(f"{FLOOR}: (e) bare ZooKeeper round trip '{mode}' x{samples}")
            floor[mode] = measure_floor(hosts, mode, samples)

        def p(mode: str, pct: float) -> float:
            return percentile(floor[mode], pct)

        self.results[FLOOR] = {
            # celery_zk's default protocol: hand-off to an idle consumer.
            "latency_p50": p("handoff", 50), "latency_p99": p("handoff", 99),
            "latency_samples": len(floor["handoff"]),
            "result_p50": p("result-handoff", 50), "result_p99": p("result-handoff", 99),
            "result_samples": len(floor["result-handoff"]),
            "claim_p50": p("claim", 50), "claim_p99": p("claim", 99),
            "claim_result_p50": p("result", 50),
            "claim_listing_p50": p("claim-listing", 50),
            "claim_listing_p99": p("claim-listing", 99),
            "get_delete_p50": p("get-delete", 50), "get_delete_p99": p("get-delete", 99),
            "split_p50": p("split", 50), "split_p99": p("split", 99)}
        self.notes.append(
            f"{FLOOR}: two plain kazoo processes doing only the ZooKeeper requests of "
            "one round trip (benchmarks/floor.py), same pauses; rt = celery_zk's "
            "default protocol (each message handed straight to the idle receiver's "
            "offer: one multi, a watch, one read), result = that request + done-node "
            "write + watch + read. Without hand-off (handoff=false: publish, then a "
            f"claim) rt was p50 {p('claim', 50):.1f} ms and result "
            f"{p('result', 50):.1f} ms; with a child watch and a "
            "listing before each claim (persistent_watches=false) rt "
            f"{p('claim-listing', 50):.1f} ms; reading and deleting "
            "instead of claiming (kombu's built-in protocol) "
            f"{p('get-delete', 50):.1f} ms; the body in a node of its "
            "own, so the claim needs no read first (not built) "
            f"{p('split', 50):.1f} ms")
