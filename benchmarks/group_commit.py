"""Would group commit of concurrent publishes pay? Raw kazoo, no Celery.

One process, one ZooKeeper session, 1 and 8 threads each storing messages of
600 bytes (a small Celery task message) with a confirm:

* ``sync``: each thread sends its own create and waits for it (what a
  confirmed ``apply_async`` does today);
* ``group commit``: a thread whose create finds none in flight sends every
  waiting one in one multi (leader/follower); the others wait for it.

This is the ceiling of what batching concurrent publishes could gain: a
Celery ``apply_async`` spends most of its time in Celery and kombu, not in
kazoo (see benchmarks/README.md, "Publishing").

    .venv/bin/python benchmarks/group_commit.py [--rounds 3] [--messages 4000]
"""
from __future__ import annotations

import argparse
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import threaded_rate  # noqa: E402
from kazoo.client import KazooClient  # noqa: E402

from celery_zk.server import SERVER_JVM_FLAGS, ZooKeeperServer  # noqa: E402

DATA = b"x" * 600


class GroupCommit:
    """Leader/follower: one multi carries every create waiting when it is sent."""

    def __init__(self, client: KazooClient, path: str) -> None:
        self.client, self.path = client, path
        self._cond = threading.Condition()
        self._waiting: list[list[bool]] = []
        self._sending = False

    def put(self) -> None:
        slot = [False]
        with self._cond:
            self._waiting.append(slot)
            while not slot[0]:
                if self._sending:
                    self._cond.wait()
                    continue
                batch, self._waiting, self._sending = self._waiting, [], True
                self._cond.release()
                try:
                    txn = self.client.transaction()
                    for _ in batch:
                        txn.create(self.path, DATA, sequence=True)
                    txn.commit()
                finally:
                    self._cond.acquire()
                for done in batch:
                    done[0] = True
                self._sending = False
                self._cond.notify_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=4000)
    args = parser.parse_args()
    server = ZooKeeperServer(jvm_flags=SERVER_JVM_FLAGS, tick_time=2000)
    server.start()
    try:
        client = KazooClient(server.hosts)
        client.start()
        client.ensure_path("/q")
        grouped = GroupCommit(client, "/q/m-")
        ways = {"sync": lambda _: client.create("/q/m-", DATA, sequence=True),
                "group commit": lambda _: grouped.put()}
        threaded_rate(ways["sync"], args.messages, 8)   # warm-up: the server's JIT
        results: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for name, put in ways.items():
                for threads in (1, 8):
                    results.setdefault((name, threads), []).append(
                        threaded_rate(put, args.messages, threads))
        client.stop()
        client.close()
    finally:
        server.close()
    print(f"{'way':<14} {'threads':>7}  messages/s (each round)")
    for (name, threads), rates in results.items():
        print(f"{name:<14} {threads:>7}  " + " · ".join(f"{r:,.0f}" for r in rates))


if __name__ == "__main__":
    main()
