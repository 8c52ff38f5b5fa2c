"""kazoo's connection on a real ZooKeeper, through celery_zk's handler and reads
(celery_zk.zk.handler, celery_zk.compat.kazoo.buffer_reads): replies and events
intact, many packets per recv(), reads right again after a connection dropped
while replies streamed in (bytes left of the old socket:
tests/unit/test_buffered_reads.py), and a busy client whose server goes silent
moves on."""
from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss
from kazoo.protocol.states import KazooState

from celery_zk.compat import kazoo as kazoo_compat
from celery_zk.zk.client import make_client
from celery_zk.zk.config import parse_url

#: kazoo's private read is replaced and its waits are ours: every supported release runs this.
pytestmark = pytest.mark.matrix


@pytest.fixture
def client(zk_url: str) -> Iterator[KazooClient]:
    client = make_client(parse_url(zk_url))
    try:
        yield client
    finally:
        client.stop()
        client.close()


def reader(client: KazooClient) -> kazoo_compat._BufferedReads:
    read = client._connection._read
    assert isinstance(read, kazoo_compat._BufferedReads), "reads are kazoo's own"
    return read


def pending_bytes(sock: socket.socket) -> int:
    """Bytes the kernel holds for ``sock``, not yet read."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]


def test_pipelined_replies_are_read_many_at_a_time(
        client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    client.ensure_path("/wire")
    paths = [f"/wire/n{i:04d}" for i in range(400)]
    for path in paths:
        client.create_async(path, path.encode() * 8)
    client.sync("/wire")
    read = reader(client)
    sock = client._connection._socket
    # Replies pile up in the socket whatever the machine's speed: while held,
    # kazoo's loop sees only its request pipe, so it sends and does not read.
    hold = threading.Event()
    select = client.handler.select

    def held_select(rlist: list[Any], wlist: list[Any], xlist: list[Any],
                    timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while hold.is_set() and any(f is sock for f in rlist):
            rest = [f for f in rlist if f is not sock]
            step = 0.01 if deadline is None else max(0.0, min(0.01, deadline - time.monotonic()))
            found = select(rest, wlist, xlist, step)
            if found[0] or found[1] or (deadline is not None and time.monotonic() >= deadline):
                return found
        return select(rlist, wlist, xlist, timeout)
    monkeypatch.setattr(client.handler, "select", held_select)

    recvs = read.recvs
    hold.set()
    pending = [client.get_async(path) for path in paths]
    waiting, settled = -1, time.monotonic() + 10
    while time.monotonic() < settled:   # until the replies stop coming
        time.sleep(0.2)
        waiting, before = pending_bytes(sock), waiting
        if waiting == before and waiting > 0:
            break
    hold.clear()
    assert [p.get(timeout=10)[0] for p in pending] == [path.encode() * 8 for path in paths]
    # kazoo reads two pieces per packet, each a recv() of its own: with the
    # buffer most come from memory.
    assert read.recvs - recvs < len(paths) / 2, (read.recvs - recvs, waiting)


def test_a_value_bigger_than_one_socket_read_comes_back_whole(client: KazooClient) -> None:
    data = bytes(range(256)) * 3900   # ~1 MB: many recv() calls for one packet
    assert len(data) > kazoo_compat.READ_SIZE * 10
    client.create("/big", data)
    assert client.get("/big")[0] == data
    assert [r.get(timeout=10)[0] for r in [client.get_async("/big") for _ in range(3)]] \
        == [data] * 3


def test_watch_events_arrive_between_replies(client: KazooClient) -> None:
    client.ensure_path("/events")
    seen: list[str] = []
    fired = threading.Event()

    def watch(event: object) -> None:
        seen.append(event.path)   # type: ignore[attr-defined]
        fired.set()
    client.get_children("/events", watch=watch)
    pending = [client.exists_async(f"/events/x{i}") for i in range(200)]
    client.create("/events/child")
    assert all(p.get(timeout=10) is None for p in pending)
    assert fired.wait(10) and seen == ["/events"]


def test_after_a_connection_dropped_mid_stream_every_reply_is_read_right(
        client: KazooClient) -> None:
    client.ensure_path("/drop")
    paths = [f"/drop/n{i:03d}" for i in range(300)]
    for path in paths:
        client.create_async(path, path.encode() * 20)
    client.sync("/drop")
    reconnected = threading.Event()
    client.add_listener(lambda state: reconnected.set() if state == KazooState.CONNECTED
                        else None)
    read = reader(client)
    pending = [client.get_async(path) for path in paths]
    # Cut the connection under kazoo while replies stream in.
    read.sock.shutdown(socket.SHUT_RDWR) if read.sock is not None else None
    outcomes = []
    for p in pending:
        try:
            outcomes.append(p.get(timeout=20)[0])
        except ConnectionLoss:
            outcomes.append(None)
    assert reconnected.wait(30)
    deadline = time.monotonic() + 10
    while client.state != KazooState.CONNECTED and time.monotonic() < deadline:
        time.sleep(0.05)
    # What came back before the drop is right; after it, every reply is.
    assert all(o is None or o == path.encode() * 20 for o, path in zip(outcomes, paths))
    again = [client.get_async(path) for path in paths]
    assert [p.get(timeout=10)[0] for p in again] == [path.encode() * 20 for path in paths]
    assert read.sock is not None and read.sock is client._connection._socket


def test_a_busy_client_cut_off_from_its_server_moves_on_and_keeps_its_session(
        zookeeper_server: Any, zk_chroot: str) -> None:
    """kazoo pings only after a quiet spell and takes every request it sends
    for one, so a client that keeps sending never noticed its server had gone
    silent: it wrote into the void until its session had expired (the
    nemesis: a worker whose server was partitioned away ran a task that was
    then requeued and run again). Now, as ZooKeeper's own client, it drops a
    connection that left a request unanswered for two thirds of the session
    timeout, and reconnects in time to keep its session."""
    from .tcpproxy import TCPProxy
    from .workers import wait_until

    host, port = zookeeper_server.hosts.rsplit(":", 1)
    with TCPProxy(host, int(port)) as proxy:
        client = make_client(parse_url(f"zk://{proxy.hosts}{zk_chroot}?session_timeout=6"))
        states: list[str] = []
        client.add_listener(states.append)
        session = client.client_id[0]
        stop = threading.Event()

        def busy() -> None:   # a worker's steady requests: acks, reads, dispatch
            while not stop.is_set():
                client.exists_async("/")
                stop.wait(0.05)
        thread = threading.Thread(target=busy, daemon=True)
        thread.start()
        try:
            stop.wait(0.5)
            proxy.cut()   # this server goes silent; a new connection gets through
            wait_until(lambda: KazooState.SUSPENDED in states, 30,
                       message="the client never noticed its server went silent")
            wait_until(lambda: client.state == KazooState.CONNECTED, 30,
                       message="the client never reconnected")
            assert KazooState.LOST not in states
            assert client.client_id[0] == session, "the session was lost"
            assert proxy.connections == 2
            assert client.exists("/") is not None
        finally:
            stop.set()
            thread.join(5)
            client.stop()
            client.close()
