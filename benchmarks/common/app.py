"""The Celery app the benchmarks' workers run, configured from the environment.

The scripts start ``celery -A common.app worker`` (:func:`common.worker.spawn_worker`)
with:

* ``BENCH_BROKER`` / ``BENCH_BACKEND``: broker and result backend URLs.
* ``BENCH_READY_FILE``: written once the worker consumes (``worker_ready``),
  because at loglevel WARNING the worker prints no "ready." line.
* ``BENCH_DRAIN_TOTAL`` / ``BENCH_DRAIN_FILE``: the ``bench.drain`` task counts
  distinct task indexes in this (threads pool: single) process and writes the
  seconds from the first execution to the last to the file when all of them have run.
* ``BENCH_TALLY_FILE``: the ``bench.tally`` task marks its index there
  (:mod:`common.tally`: one drain counted across many processes).
* ``BENCH_LATE_FILE``: the ``bench.late`` task appends its index and lateness
  (its start minus the eta it was given) there (``delayed.py``).
* ``BENCH_GATE_FILE``: once ready, the worker waits for this file before its
  consumer loop runs, so that K workers started one after another begin together.
* ``BENCH_PRELOAD``: ``{total}`` (and ``-Q``'s queue): the worker stores that
  backlog itself as it starts, before it consumes: on ``memory://``, whose
  queues live in the worker's process, Celery's own ceiling (``workers.py``).

A broker URL that starts with :data:`QUORUM` is RabbitMQ as it replicates:
Celery's quorum queues (``task_default_queue_type``, and
``task_create_missing_queue_type`` for the scripts' own queues) and confirmed
publishes.

The client imports :func:`make_app` to get the same task names on any broker, and
:func:`preload` to store a backlog before any worker runs.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any

from celery import Celery, Task
from celery.signals import worker_init, worker_ready
from kombu import Connection
from kombu.exceptions import ChannelError

import celery_zk  # noqa: F401  (registers the zk:// transport alias)

from .tally import record as record_tally
from .worker import announce_ready

ECHO = "bench.echo"
DRAIN = "bench.drain"
ADD = "bench.add"
MARK = "bench.mark"
NOOP = "bench.noop"
IDENTITY = "bench.identity"
MAKE = "bench.make"
TALLY = "bench.tally"
LATE = "bench.late"
QUORUM = "quorum+"


def _echo(self: Task, reply_queue: str, token: str) -> None:
    """Reply on the broker itself, so a round trip needs no result backend."""
    with self.app.producer_pool.acquire(block=True) as producer:
        producer.publish({"token": token}, exchange="", routing_key=reply_queue,
                         serializer="json", retry=True)


class _DrainState:
    lock = threading.Lock()
    seen: set[int] = set()
    executions = 0
    first: float | None = None
    written = False


def _drain(index: int) -> None:
    now = time.monotonic()
    total = int(os.environ.get("BENCH_DRAIN_TOTAL", "0"))
    state = _DrainState
    with state.lock:
        state.executions += 1
        state.seen.add(index)
        if state.first is None:
            state.first = now
        if state.written or not total or len(state.seen) < total:
            return
        state.written = True
        report = {"elapsed": now - state.first, "distinct": len(state.seen),
                  "executions": state.executions}
    path = os.environ["BENCH_DRAIN_FILE"]
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(report, fh)
    os.replace(path + ".tmp", path)  # the client never reads a half-written file


def _add(x: int, y: int) -> int:
    return x + y


def _mark(port: int, token: str) -> None:
    """Tell the client (a UDP datagram) when the task body started: one-way
    delivery measured without the task publishing anything on the broker."""
    started = time.monotonic()   # CLOCK_MONOTONIC: the same clock in every process
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(f"{token} {started!r}".encode(), ("127.0.0.1", port))


def _noop(index: int) -> None:
    """Background load: a task that does nothing and publishes nothing."""


def _identity(value: object) -> object:
    """Returns its argument: a payload goes to the worker and comes back."""
    return value


def _make(size: int) -> str:
    """A result of ``size`` bytes from a small message."""
    return "x" * size


def _tally(index: int) -> None:
    """A no-op task that publishes nothing, counted across processes (``workers.py``)."""
    record_tally(os.environ["BENCH_TALLY_FILE"], index)


def _late(index: int, eta: float) -> None:
    """An eta task: ``{index} {seconds late}`` appended to ``BENCH_LATE_FILE``, one
    ``O_APPEND`` write, so lines of threads and processes never interleave."""
    line = f"{index} {time.time() - eta:.6f}\n".encode()
    fd = os.open(os.environ["BENCH_LATE_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def broker_url(url: str) -> str:
    """What kombu is given for a URL of these scripts (:data:`QUORUM` taken off)."""
    return url.removeprefix(QUORUM)


def make_app(broker: str, backend: str | None = None) -> Celery:
    app = Celery("common.app", broker=broker_url(broker), backend=backend or None,
                 set_as_current=False)
    if broker.startswith(QUORUM):
        app.conf.update(task_default_queue_type="quorum", task_create_missing_queue_type="quorum",
                        broker_transport_options={"confirm_publish": True})
    elif broker.startswith("memory://"):   # the ceiling: no pause between looks (1 s)
        app.conf.broker_transport_options = {"polling_interval": 0}
    app.conf.update(
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        worker_prefetch_multiplier=4,   # Celery's default, said
    )
    app.task(name=ECHO, bind=True, ignore_result=True)(_echo)
    app.task(name=DRAIN, ignore_result=True)(_drain)
    app.task(name=ADD)(_add)
    app.task(name=MARK, ignore_result=True)(_mark)
    app.task(name=NOOP, ignore_result=True)(_noop)
    app.task(name=IDENTITY)(_identity)
    app.task(name=MAKE)(_make)
    app.task(name=TALLY, ignore_result=True)(_tally)
    app.task(name=LATE, ignore_result=True)(_late)
    return app


def waiting(url: str, queue: str) -> int:
    """Messages stored in ``queue``."""
    with Connection(broker_url(url)) as conn:
        try:
            return int(conn.default_channel.queue_declare(queue, passive=True).message_count)
        except ChannelError:   # Redis: an emptied list is no key, so no queue
            return 0


def preload(url: str, queue: str, total: int) -> None:
    """``total`` ``bench.tally`` tasks (indexes 0..total-1), stored before any worker runs."""
    app = make_app(url)
    if url.startswith("zk://"):   # pipelined: the preload is not what is measured
        app.conf.broker_transport_options = {"confirm_publish": False}
    task = app.tasks[TALLY]
    try:
        with app.producer_or_acquire() as producer:
            for index in range(total):
                task.apply_async((index,), queue=queue, producer=producer)
    finally:
        app.close()
    deadline = time.monotonic() + 300
    while (stored := waiting(url, queue)) < total:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: only {stored} of {total} tasks stored in {queue}")
        time.sleep(0.2)


app = make_app(os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/0"),
               os.environ.get("BENCH_BACKEND"))


announce_ready("BENCH_READY_FILE")


@worker_init.connect
def _preload(sender: Any, **_: Any) -> None:
    """``BENCH_PRELOAD``: the backlog stored by the worker itself, before it consumes."""
    if total := int(os.environ.get("BENCH_PRELOAD", "0")):
        queue, = (queue.name for queue in sender.app.amqp.queues.consume_from.values())
        preload(sender.app.conf.broker_url, queue, total)


@worker_ready.connect
def _wait_at_the_gate(**_: Any) -> None:
    """After the ready file (announce_ready connected first): K workers started
    one after another begin together (workers.py, pair.py)."""
    gate = os.environ.get("BENCH_GATE_FILE")
    # Sent before the consumer loop's first turn: holding it here holds the
    # worker's task execution (prefetched messages wait in the worker).
    while gate and not os.path.exists(gate):
        time.sleep(0.005)
