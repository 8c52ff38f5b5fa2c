"""The processes of a run (consumers, a dispatcher, a steady publisher), their
entry points, and publishing."""
from __future__ import annotations

import logging
import multiprocessing
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict
from typing import Any

from kazoo.client import KazooClient

from celery_zk.server import ZooKeeperServer

from . import wire
from .config import BUCKET_SIZE, Counts, Paths, Report, Run, consumer_ids, make_body, make_client
from .consumers import Consumer, InboxConsumer, SelfClaimConsumer
from .dispatcher import Dispatcher

logger = logging.getLogger(__name__)

class Sync:
    """What the main process shares with the processes it starts."""

    def __init__(self, ctx: Any, slots: int) -> None:
        self.go = ctx.Event()
        self.stop = ctx.Event()
        self.ready = ctx.Queue()
        self.results = ctx.Queue()
        self.holds = ctx.Queue()
        self.progress = ctx.RawArray("q", max(1, slots))


def consumer_process(hosts: str, run: Run, index: int, sync: Sync, latency: bool) -> None:
    """One consumer (consumer 0 also runs the dispatcher thread, unless it has a process)."""
    logging.basicConfig(level=logging.WARNING)
    client = make_client(hosts, run.tuning)
    router = wire.TreeRouter(client) if _needs_router(run) else None
    paths = Paths(run.root)
    cid = consumer_ids(run.k)[index]
    report = Report(index, Counts())
    holds = sync.holds if latency else None
    try:
        client.create(paths.liveness(cid), ephemeral=True)
        consumer: Consumer
        if run.variant == "selfclaim" and run.mode != "latency-direct":
            consumer = SelfClaimConsumer(client, router, run, cid, report, sync.progress, index,
                                         holds, place=index)
        else:
            consumer = InboxConsumer(client, router, run, cid, report, sync.progress, index,
                                     holds, offers=run.mode == "latency-direct")
        consumer.prepare()
        dispatcher = None
        if run.dispatched and run.dispatcher == "thread" and index == 0:
            dispatcher = Dispatcher(client, router, run, Counts())
            _wait_for_consumers(client, paths, run.k)
            dispatcher.prepare()
        sync.ready.put(index)
        sync.go.wait()
        stop = threading.Event()
        threads = [threading.Thread(target=_watch_stop, args=(sync.stop, stop, consumer.wake,
                                                               dispatcher), daemon=True)]
        if dispatcher is not None:
            threads.append(threading.Thread(target=dispatcher.loop, args=(stop,), daemon=True))
        for thread in threads:
            thread.start()
        consumer.loop(stop)
        for thread in threads:
            thread.join(5)
        if dispatcher is not None:
            report.dispatcher = dispatcher.counts
    except Exception as exc:
        logger.exception("consumer %s failed", cid)
        report.errors.append(f"{cid}: {exc!r}")
    finally:
        time.sleep(0.05)   # let the last ack replies land
        sync.results.put(("consumer", asdict(report)))
        client.stop()
        client.close()


def dispatcher_process(hosts: str, run: Run, sync: Sync) -> None:
    logging.basicConfig(level=logging.WARNING)
    client = make_client(hosts, run.tuning)
    router = wire.TreeRouter(client) if _needs_router(run) else None
    counts = Counts()
    errors: list[str] = []
    try:
        dispatcher = Dispatcher(client, router, run, counts)
        _wait_for_consumers(client, Paths(run.root), run.k)
        dispatcher.prepare()
        sync.ready.put("dispatcher")
        sync.go.wait()
        stop = threading.Event()
        threading.Thread(target=_watch_stop, args=(sync.stop, stop, dispatcher.wake, None),
                         daemon=True).start()
        dispatcher.loop(stop)
    except Exception as exc:
        logger.exception("dispatcher failed")
        errors.append(f"dispatcher: {exc!r}")
    finally:
        sync.results.put(("dispatcher", {"counts": asdict(counts), "errors": errors}))
        client.stop()
        client.close()


def publisher_process(hosts: str, run: Run, sync: Sync) -> None:
    """A steady publisher: message i is sent at go + i / rate, pipelined."""
    logging.basicConfig(level=logging.WARNING)
    client = make_client(hosts, run.tuning)
    errors: list[str] = []
    try:
        sync.ready.put("publisher")
        sync.go.wait()
        start = time.monotonic()
        publish(client, run, range(run.messages), pace=(start, run.rate))
        sync.stop.wait()   # stay until the end: its CPU is read then
    except Exception as exc:
        logger.exception("publisher failed")
        errors.append(f"publisher: {exc!r}")
    finally:
        sync.results.put(("publisher", {"errors": errors}))
        client.stop()
        client.close()


def _needs_router(run: Run) -> bool:
    t = run.tuning
    return "tree" in (t.inbox_watch, t.credit_watch, t.unowned_watch)


def _wait_for_consumers(client: KazooClient, paths: Paths, k: int) -> None:
    deadline = time.monotonic() + 60
    while len(client.get_children(paths.consumers)) < k:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {k} consumers registered within 60 s")
        time.sleep(0.02)


def _watch_stop(outer: Any, inner: threading.Event, *wakes: Any) -> None:
    """Turn the cross-process stop into this process's, and wake its loops."""
    outer.wait()
    inner.set()
    for wake in wakes:
        if wake is not None:
            (wake if isinstance(wake, threading.Event) else wake.wake).set()


# -- publishing -------------------------------------------------------------------------
def publish(client: KazooClient, run: Run, indices: range,
            pace: tuple[float, float] | None = None) -> None:
    """Publish ``indices`` pipelined (``pace``: (start, rate) spreads them out)."""
    paths = Paths(run.root)
    window: deque[Any] = deque()
    gen_made = -1
    for index in indices:
        if pace is not None:
            delay = pace[0] + index / pace[1] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        gen = index // BUCKET_SIZE
        if gen != gen_made:
            client.ensure_path(paths.bucket(gen))
            gen_made = gen
        uid = uuid.uuid4().hex[:16]
        body = make_body(index, run.size)
        if run.names:   # name and body in one multi: never a name without its body
            txn = client.transaction()
            txn.create(paths.message_prefix(gen, uid, True), b"", sequence=True)
            txn.create(paths.body(gen, uid), body)
            window.append(txn.commit_async())
        else:
            window.append(client.create_async(paths.message_prefix(gen, uid, False), body,
                                              sequence=True))
        while window and (len(window) >= 500 or window[0].ready()):
            result = window.popleft().get()
            if isinstance(result, list) and wire.multi_failure(result) is not None:
                raise RuntimeError(f"publish failed: {result!r}")
    while window:
        window.popleft().get()


class Cluster:
    """The processes of one run, started together, stopped by pid at the end."""

    def __init__(self, zk: ZooKeeperServer, run: Run, latency: bool = False) -> None:
        self.zk, self.run = zk, run
        self.ctx = multiprocessing.get_context("spawn")   # no kazoo client crosses a fork
        self.sync = Sync(self.ctx, run.k)
        self.procs: list[tuple[str, Any]] = []
        for index in range(run.k):
            self.procs.append(("consumer", self.ctx.Process(
                target=consumer_process, args=(zk.hosts, run, index, self.sync, latency),
                daemon=True)))
        if run.dispatched and run.dispatcher == "process":
            self.procs.append(("dispatcher", self.ctx.Process(
                target=dispatcher_process, args=(zk.hosts, run, self.sync), daemon=True)))
        if run.mode == "steady":
            self.procs.append(("publisher", self.ctx.Process(
                target=publisher_process, args=(zk.hosts, run, self.sync), daemon=True)))

    def start(self) -> None:
        for _, proc in self.procs:
            proc.start()
        deadline = time.monotonic() + 90
        for _ in self.procs:
            remaining = deadline - time.monotonic()
            try:
                self.sync.ready.get(timeout=max(0.1, remaining))
            except Exception:
                dead = [p.pid for _, p in self.procs if not p.is_alive()]
                raise RuntimeError(f"processes not ready within 90 s (dead: {dead})") from None

    def pids(self) -> list[int]:
        return [proc.pid for _, proc in self.procs]

    def stop(self) -> list[tuple[str, dict[str, Any]]]:
        self.sync.stop.set()
        results = []
        for _ in self.procs:
            try:
                results.append(self.sync.results.get(timeout=30))
            except Exception:
                break
        for _, proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        return results
