"""Latency in the shapes users run, p50/p99 ms, idle or under a steady load.

One ``-P threads -c 4`` worker, the broker's own kind of result backend
(zk: celery_zk's; Redis: Redis db 1; RabbitMQ: ``rpc://``); 200 samples
20-50 ms apart by default (:func:`common.figures.sample`):

* ``oneway``: ``apply_async`` until the task body starts, seen through a UDP
  datagram the task sends; the task publishes nothing and has no result.
  Also: how long the ``apply_async`` call itself took (on zk it returns once
  the message is stored);
* ``get``: ``delay().get()``;
* ``roundtrip``: the task publishes a reply on the broker and the client
  consumes it (what Celery's ``rpc://`` results and remote control do).

"Loaded": another process publishes a no-op task into the same queue, for the
same worker, at a steady rate (:func:`common.load.load`).
"""
from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from celery import Celery
from kombu import Connection, Queue

from .app import ADD, ECHO, MARK, broker_url, make_app
from .figures import PAIRS, percentile, sample, table
from .load import load
from .processes import Processes
from .worker import Workers

SHAPES = ("oneway", "get", "roundtrip")


class Latency:
    """The latency shapes against one broker's server."""

    def __init__(self, name: str, url: str, backend: str, procs: Processes,
                 work_dir: str) -> None:
        self.name, self.url, self.backend = name, url, backend
        self.procs, self.work_dir = procs, work_dir
        self.workers = Workers(procs, work_dir, f"{name}-latency-")

    def measure(self, samples: int, rate: float) -> dict[str, dict[str, float]]:
        """Each shape's p50 and p99, under ``rate`` tasks/s of load (none if 0)."""
        queue = f"latency-{uuid.uuid4().hex[:8]}"
        app = make_app(self.url, self.backend)
        out: dict[str, dict[str, float]] = {}
        publishes: list[float] = []
        with self.workers.worker(self.url, queue, backend=self.backend), \
                load(self.procs, self.work_dir, self.url, queue, rate):
            for shape, sampler in (
                    ("oneway", oneway(partial(app.tasks[MARK].apply_async, queue=queue),
                                      publishes)),
                    ("get", result_round_trip(app, queue, self.name)),
                    ("roundtrip", reply_round_trip(app, self.url, queue, f"{queue}-reply"))):
                with sampler as once:
                    values = sample(once, samples)
                out[shape] = {"p50": percentile(values, 50), "p99": percentile(values, 99),
                              "n": samples}
        # How much of the one-way time the publishing call itself took (the
        # warm-up's calls left out): on zk the durable write it waits for.
        publishes = [seconds * 1000 for seconds in publishes[-samples:]]
        out["oneway"].update(publish_p50=percentile(publishes, 50),
                             publish_p99=percentile(publishes, 99))
        app.close()
        return out


# -- samplers: each once() is one sample, in seconds ----------------------------------------
@contextmanager
def oneway(send: Callable[[tuple[int, str]], object], publishes: list[float]
           ) -> Iterator[Callable[[], float]]:
    """Tasks published by ``send((port, token))``, ``bench.mark`` or one like it
    (``affinity.py``'s): each tells the client by UDP when its body started. How
    long each ``send`` took is appended to ``publishes``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(30)
        port = sock.getsockname()[1]

        def once() -> float:
            token = uuid.uuid4().hex
            sent = time.monotonic()
            send((port, token))
            publishes.append(time.monotonic() - sent)
            while True:
                got, started = sock.recv(200).decode().split()
                if got == token:
                    return float(started) - sent
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

    with Connection(broker_url(url)) as conn, conn.Consumer(
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


COLUMNS = [f"{shape} {state}" for state in ("idle", "loaded") for shape in SHAPES]


def render(results: dict[str, Any], load_rate: float) -> str:
    """The shapes of each broker (``{name: {"oneway idle": {...}, ...}}``), and the
    ratios of :data:`~common.figures.PAIRS`."""
    out = [f"Latency p50 / p99 ms ('loaded': {load_rate:.0f} no-op tasks/s into the same queue)"]
    rows = [["broker", *COLUMNS]]
    for name, row in results.items():
        if any(key in row for key in COLUMNS):
            rows.append([name, *(f"{row[k]['p50']:.2f} / {row[k]['p99']:.2f}" if k in row
                                 else "-" for k in COLUMNS)])
    for ours, other in PAIRS:
        zk, theirs = results.get(ours, {}), results.get(other, {})
        if zk and any(k in zk and k in theirs for k in COLUMNS):
            rows.append([f"{ours} / {other}", *(
                f"{zk[k]['p50'] / theirs[k]['p50']:.2f} / {zk[k]['p99'] / theirs[k]['p99']:.2f}"
                if k in zk and k in theirs else "-" for k in COLUMNS)])
    if len(rows) > 1:
        out += table(rows)
    calls = [f"{name} {state} {row[f'oneway {state}']['publish_p50']:.2f}"
             for name, row in results.items() for state in ("idle", "loaded")
             if "publish_p50" in row.get(f"oneway {state}", {})]
    if calls:
        out += ["oneway: p50 ms of it in apply_async itself (zk: it returns once the write "
                "is stored): " + ", ".join(calls)]
    return "\n".join(out)
