"""The bare ZooKeeper operations of one round trip: a floor for the latency targets.

``bench.py`` compares a Celery round trip over ``zk://`` with one over Redis.
This module measures what the ZooKeeper part alone costs on the same
machine and server: two processes, plain kazoo clients, no Celery and no
kombu, doing exactly the requests a round trip needs, with the same idle
pauses between samples. Whatever Celery adds comes on top, so when the floor
is already above a target ratio, no ZooKeeper transport can meet it here.

Modes (each sample: the client sends one message and waits for the answer):

* ``claim``: celery_zk's protocol on both sides. Publish is one sequential
  create; the idle receiver is woken by its persistent recursive watch
  (:mod:`celery_zk.zk.watches`), which names the new node, reads the message
  (the read started from the watch callback, as celery_zk does) and claims
  it with one multi (delete from unowned + create in owned), then acks
  asynchronously.
* ``claim-listing``: the same, woken by a one-shot child watch instead, so
  each delivery lists the directory first (celery_zk with
  ``persistent_watches=false``, or a ZooKeeper before 3.6).
* ``get-delete``: woken by a child watch, the receiver lists, reads and
  deletes the message instead of claiming it (kombu's built-in transport,
  minus its one-second polling). Not crash-safe.
* ``result``: the request side as ``claim``; the worker side then writes a
  done node and its expiry-index entry in one multi (the result backend's
  write) and the client, woken by an exists watch on that node, reads it.
* ``handoff``: celery_zk's default protocol (option ``handoff``,
  :mod:`celery_zk.broker.handoff`). An idle receiver leaves an ephemeral *offer* node; the
  sender publishes by deleting the offer and creating the message directly in
  ``owned/`` in one multi, so the receiver, woken by the offer's deletion,
  reads the message and has no claim to make. The receiver makes its next
  offer after it has answered (untimed), as a consumer would once idle again.
* ``result-handoff``: ``result`` with the request handed over as in ``handoff``
  (what celery_zk does by default).
* ``split``: another design celery_zk does **not** implement. The message
  body lives in a node of its own (``data/{uid}``, created in the same multi
  as the empty ``unowned/`` node), so a claim needs no read first: the watch
  callback sends the claim multi and the body's read together, and the ack
  deletes both nodes.

Run alone: ``.venv/bin/python benchmarks/floor.py [--samples 200] [--modes claim,split]
[--rounds 3]``.
"""
from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import threading
import time
import uuid
from collections import deque
from typing import Any

from kazoo.client import KazooClient

from celery_zk.zk.config import parse_url
from celery_zk.zk.watches import NODE_CREATED, TreeWatches

PAYLOAD = b"x" * 1200   # about one Celery task message
MODES = ("claim", "claim-listing", "get-delete", "result", "handoff", "split",
         "result-handoff")
RESULT_MODES = ("result", "result-handoff")


def _request_mode(mode: str) -> str:
    """How the request travels: result-handoff hands it over, as handoff does."""
    return "handoff" if mode == "result-handoff" else mode
WARM_UP = 5


class _Waiter:
    """A child or exists watch that wakes the calling thread (as the transport's)."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self, _event: Any) -> None:
        self.event.set()


class _Handle:
    """What :class:`TreeWatches` needs of a ClientHandle, for a plain client."""

    def __init__(self, client: KazooClient, hosts: str) -> None:
        self.client = client
        self.settings = parse_url(f"zk://{hosts}")

    def add_listener(self, listener: Any) -> None:
        self.client.add_listener(listener)


class _Receiver:
    """Takes the next message off one queue's unowned directory, as a consumer does."""

    def __init__(self, client: KazooClient, hosts: str, queue: str, mode: str) -> None:
        self.client, self.queue, self.mode = client, queue, mode
        self.waiter = _Waiter()
        self.arrivals: deque[str] = deque()
        self.reads: dict[str, Any] = {}
        self.offers = 0   # handoff: offers made so far; the sender counts the same way
        # Woken with the new message's name (tree watch, or a taken offer), not
        # by a child watch that needs a listing.
        self.named = mode not in ("claim-listing", "get-delete")
        if mode == "handoff":
            self.offer()
        elif mode in ("claim", "result", "split"):
            def on_tree(event_type: int, name: str) -> None:   # kazoo's connection thread
                if event_type != NODE_CREATED or not name:
                    return
                if mode == "split":   # claim and read at once: the claim needs no body
                    txn = client.transaction()
                    txn.delete(f"{queue}/unowned/{name}")
                    txn.create(f"{queue}/owned/{name}")
                    self.reads[name] = (txn.commit_async(),
                                        client.get_async(f"{queue}/data/{split_uid(name)}"))
                else:
                    # As celery_zk's idle consumer: the read starts from the callback.
                    self.reads[name] = client.get_async(f"{queue}/unowned/{name}")
                self.arrivals.append(name)
                self.waiter.event.set()
            if not TreeWatches(_Handle(client, hosts)).watch(f"{queue}/unowned", on_tree):  # type: ignore[arg-type]
                raise RuntimeError("floor: this ZooKeeper has no persistent watches")

    def offer(self) -> None:
        """handoff: offer to take the next message directly (ephemeral, so it dies with us)."""
        client, queue, number = self.client, self.queue, self.offers
        self.offers += 1

        def on_taken(_event: Any) -> None:   # the sender deleted the offer
            self.reads[handoff_name(number)] = client.get_async(
                f"{queue}/owned/{handoff_name(number)}")
            self.arrivals.append(handoff_name(number))
            self.waiter.event.set()
        path = f"{queue}/offers/{handoff_name(number)}"
        client.create(path, ephemeral=True)
        client.exists(path, watch=on_taken)

    def _next_name(self) -> str:
        if self.named:
            while not self.arrivals:
                self.waiter.event.wait()
                self.waiter.event.clear()
            return self.arrivals.popleft()
        while True:
            self.waiter.event.clear()
            names = self.client.get_children(f"{self.queue}/unowned", watch=self.waiter)
            if names:
                return min(names)
            self.waiter.event.wait()

    def receive(self) -> bytes:
        client, queue = self.client, self.queue
        name = self._next_name()
        if self.mode == "handoff":   # already ours: read it, ack it
            data, _ = self.reads.pop(name).get()
            client.delete_async(f"{queue}/owned/{name}")
            return bytes(data)
        if self.mode == "split":
            claim, read = self.reads.pop(name)
            if claim.get()[0] is not True:
                raise RuntimeError(f"floor: claim of {name} failed")
            data, _ = read.get()
            txn = client.transaction()   # the ack: message and body
            txn.delete(f"{queue}/owned/{name}")
            txn.delete(f"{queue}/data/{split_uid(name)}")
            txn.commit_async()
            return bytes(data)
        path = f"{queue}/unowned/{name}"
        read = self.reads.pop(name, None)
        data, stat = read.get() if read is not None else client.get(path)
        if self.mode == "get-delete":
            client.delete(path, version=stat.version)
            return bytes(data)
        txn = client.transaction()
        txn.delete(path, version=stat.version)
        txn.create(f"{queue}/owned/{name}", data)
        txn.commit()
        client.delete_async(f"{queue}/owned/{name}")  # the ack: asynchronous, as in celery_zk
        return bytes(data)


def handoff_name(number: int) -> str:
    return f"h-{number:010d}"


def split_uid(name: str) -> str:
    return name.split("-")[1]


def _send(client: KazooClient, queue: str, mode: str, number: int, data: bytes) -> None:
    """Publish message ``number`` to ``queue`` the way ``mode`` does."""
    if mode == "handoff":   # straight into owned/, in place of the receiver's offer
        txn = client.transaction()
        txn.delete(f"{queue}/offers/{handoff_name(number)}")
        txn.create(f"{queue}/owned/{handoff_name(number)}", data)
    elif mode == "split":   # an empty unowned/ node, the body beside it
        uid = uuid.uuid4().hex
        txn = client.transaction()
        txn.create(f"{queue}/unowned/m-{uid}-", sequence=True)
        txn.create(f"{queue}/data/{uid}", data)
    else:
        client.create(f"{queue}/unowned/m-", data, sequence=True)
        return
    results = txn.commit()
    if any(isinstance(result, Exception) for result in results):
        raise RuntimeError(f"floor: {mode} publish {number} to {queue} failed: {results!r}")


def _worker_side(hosts: str, root: str, mode: str, count: int,
                 ready: Any) -> None:
    client = KazooClient(hosts)
    client.start()
    receiver = _Receiver(client, hosts, f"{root}/requests", _request_mode(mode))
    ready.set()
    try:
        for number in range(count):
            data = receiver.receive()
            if mode in RESULT_MODES:
                reply_id = data[:32].decode()
                txn = client.transaction()
                txn.create(f"{root}/done/{reply_id}", PAYLOAD[:200])
                txn.create(f"{root}/expiry/{reply_id}")
                txn.commit()
            else:
                _send(client, f"{root}/replies", mode, number, PAYLOAD)
            if _request_mode(mode) == "handoff":
                receiver.offer()   # idle again, once the answer is out
    finally:
        client.stop()
        client.close()


def measure(hosts: str, mode: str, samples: int, seed: int = 1) -> list[float]:
    """Milliseconds of each of ``samples`` round trips (after a few warm-ups)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    root = f"/floor-{mode}-{random.getrandbits(32):08x}"
    client = KazooClient(hosts)
    client.start()
    for path in ("requests/unowned", "requests/owned", "requests/offers", "requests/data",
                 "replies/unowned", "replies/owned", "replies/offers", "replies/data",
                 "done", "expiry"):
        client.ensure_path(f"{root}/{path}")
    total = samples + WARM_UP
    context = multiprocessing.get_context("spawn")  # no kazoo client crosses a fork
    ready = context.Event()
    worker = context.Process(target=_worker_side, args=(hosts, root, mode, total, ready),
                             daemon=True)
    worker.start()
    pauses = random.Random(seed)
    waiter = _Waiter()
    replies = None if mode in RESULT_MODES else _Receiver(client, hosts, f"{root}/replies", mode)
    values: list[float] = []
    try:
        deadline = time.monotonic() + 60
        while not ready.wait(0.1):
            if not worker.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"floor: the worker-side process did not start "
                                   f"(exit code {worker.exitcode}); its error is above")
        time.sleep(0.3)  # let it arm its watch
        for index in range(total):
            time.sleep(pauses.uniform(0.020, 0.050))
            reply_id = f"{index:032d}"
            start = time.perf_counter()
            _send(client, f"{root}/requests", _request_mode(mode), index,
                  reply_id.encode() + PAYLOAD)
            if mode in RESULT_MODES:
                done = f"{root}/done/{reply_id}"
                while True:
                    waiter.event.clear()
                    if client.exists(done, watch=waiter) is not None:
                        break
                    waiter.event.wait()
                client.get(done)
            else:
                assert replies is not None
                replies.receive()
            if index >= WARM_UP:
                values.append((time.perf_counter() - start) * 1000)
            if replies is not None and mode == "handoff":
                replies.offer()
        worker.join(30)
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()
        client.delete(root, recursive=True)
        client.stop()
        client.close()
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated modes to run (default all: {','.join(MODES)})")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the modes this many times, every other round in reverse "
                             "order, so no mode always gets the warmer server")
    sys.path.insert(0, __file__.rpartition("/")[0])
    from common import add_server_options, measured_server, percentile, warm_up_zookeeper

    add_server_options(parser)
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    with measured_server(args) as zk:
        zk.start()
        warm_up_zookeeper(zk.hosts)
        for round_ in range(args.rounds):
            for mode in modes if round_ % 2 == 0 else modes[::-1]:
                values = measure(zk.hosts, mode, args.samples)
                print(f"round {round_ + 1}  {mode:13s} p50 {percentile(values, 50):6.2f} ms  "
                      f"p99 {percentile(values, 99):6.2f} ms  "
                      f"mean {statistics.fmean(values):6.2f} ms  (n={len(values)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
