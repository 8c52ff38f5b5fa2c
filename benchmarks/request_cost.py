"""What one ZooKeeper request costs here, idle and back to back, kazoo and raw.

The latency targets compare a chain of dependent ZooKeeper requests with a
Redis round trip. This script prices the links of that chain on this
machine, against a fresh ZooKeeper started like ``bench.py``'s:

* ``kazoo``: a plain ``KazooClient``. Each request crosses two threads in the
  client (caller -> connection thread -> caller).
* ``raw``: the same requests written to the socket by the calling thread
  (kazoo's own serialization, no connection thread): the server's part plus
  one socket wake-up. No library can go below it.
* ``idle``: a 10-30 ms pause before each request, as between the benchmark's
  samples, so the threads and cores involved have gone to sleep.
  ``back to back``: no pause.
* ``fdatasync``: one 1.3 KB append + fdatasync on the filesystem of the
  server's data directory (ZooKeeper's ``forceSync=yes`` write).

Run: ``.venv/bin/python benchmarks/request_cost.py [--samples 300]
[--zk-force-sync no] [--zk-jvm-flag FLAG ...]`` (the server options as
``bench.py``'s).
"""
from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

from kazoo.client import KazooClient
from kazoo.protocol.serialization import Connect, Create, Exists, Transaction, int_struct
from kazoo.security import OPEN_ACL_UNSAFE

SEQUENTIAL = 2  # ZooKeeper's create flag for a persistent sequential node
PAYLOAD = b"x" * 1200


class RawClient:
    """One ZooKeeper session driven synchronously from the calling thread."""

    def __init__(self, hosts: str) -> None:
        host, _, port = hosts.partition(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.xid = 0
        self._send(Connect(0, 0, 10000, 0, b"\x00" * 16, False).serialize())
        self._receive()

    def _send(self, body: bytes) -> None:
        self.sock.sendall(int_struct.pack(len(body)) + body)

    def _receive(self) -> bytes:
        length = int_struct.unpack(self._read(4))[0]
        return self._read(length)

    def _read(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError("ZooKeeper closed the connection")
            data += chunk
        return data

    def call(self, request: Exists | Create | Transaction) -> None:
        self.xid += 1
        self._send(int_struct.pack(self.xid) + int_struct.pack(request.type)
                   + request.serialize())
        self._receive()  # no watches are set, so the next frame is the reply

    def close(self) -> None:
        self.sock.close()


def timed(call: Callable[[], object], samples: int, idle: bool) -> float:
    """p50 milliseconds of ``call``."""
    values = []
    for _ in range(samples):
        if idle:
            time.sleep(random.uniform(0.010, 0.030))
        start = time.perf_counter()
        call()
        values.append((time.perf_counter() - start) * 1000)
    return statistics.median(values)


def fdatasync_p50(directory: str, samples: int) -> float:
    fd, path = tempfile.mkstemp(dir=directory)
    try:
        def append_and_sync() -> None:
            os.write(fd, PAYLOAD + b"x" * 100)
            os.fdatasync(fd)
        return timed(append_and_sync, samples, idle=True)
    finally:
        os.close(fd)
        os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=300)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import add_server_options, measured_server, warm_up_zookeeper

    add_server_options(parser)
    args = parser.parse_args(argv)
    with measured_server(args) as zk:
        zk.start()
        warm_up_zookeeper(zk.hosts)
        kazoo = KazooClient(zk.hosts)
        kazoo.start()
        kazoo.ensure_path("/requests")
        raw = RawClient(zk.hosts)
        calls: dict[str, dict[str, Callable[[], object]]] = {
            "exists": {"kazoo": lambda: kazoo.exists("/requests"),
                       "raw": lambda: raw.call(Exists("/requests", False))},
            "create": {"kazoo": lambda: kazoo.create("/requests/m-", PAYLOAD, sequence=True),
                       "raw": lambda: raw.call(Create("/requests/m-", PAYLOAD,
                                                      OPEN_ACL_UNSAFE, SEQUENTIAL))},
        }
        try:
            print(f"ZooKeeper forceSync={args.zk_force_sync} "
                  f"{' '.join(args.zk_jvm_flag)}".rstrip(), flush=True)
            for op, clients in calls.items():
                for idle in (True, False):
                    figures = "  ".join(f"{name} {timed(call, args.samples, idle):5.2f} ms"
                                        for name, call in clients.items())
                    print(f"{op:7s} {'idle' if idle else 'back to back':13s} p50: {figures}",
                          flush=True)
            print(f"fdatasync of the data dir's filesystem p50: "
                  f"{fdatasync_p50(zk.data_dir, args.samples):5.2f} ms", flush=True)
        finally:
            raw.close()
            kazoo.stop()
            kazoo.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
