"""celery_zk.compat.kazoo's buffered reads on socket pairs: packets handed out
of one recv(), the poll told what waits, a new connection starts clean, watch
events behind one taken up to the first reply; and the handler's answers while
packets wait in the buffer."""
from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from kazoo.exceptions import ConnectionDropped

from celery_zk.compat.kazoo import READ_SIZE, _BufferedReads
from celery_zk.zk.handler import HELD_PEEK, PollingHandler


class Connection:
    """What the reader uses of kazoo's ConnectionHandler."""

    def __init__(self, sock: socket.socket) -> None:
        self._socket = sock
        self.handler = PollingHandler()

    @contextmanager
    def _socket_error_handling(self) -> Iterator[None]:
        try:
            yield
        except OSError as exc:   # as kazoo's does
            raise ConnectionDropped(f"socket connection error: {exc}") from exc


def never(length: int, timeout: float) -> bytes:
    raise AssertionError("kazoo's own read was used")


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made: list[tuple[socket.socket, socket.socket]] = []
    yield made
    for a, b in made:
        a.close()
        b.close()


def pair(pairs: list[tuple[socket.socket, socket.socket]]) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)   # as kazoo's socket
    pairs.append((a, b))
    return a, b


def packet(body: bytes) -> bytes:
    return struct.pack("!i", len(body)) + body


def read_packet(read: _BufferedReads) -> bytes:
    length = struct.unpack("!i", read(4, 1.0))[0]
    return read(length, 1.0)


def test_packets_sent_together_come_out_of_one_recv(pairs: list) -> None:
    ours, theirs = pair(pairs)
    conn = Connection(ours)
    read = _BufferedReads(conn, never, conn.handler)
    bodies = [f"reply {i}".encode() * (i + 1) for i in range(50)]
    theirs.sendall(b"".join(packet(b) for b in bodies))
    got = []
    for i, _ in enumerate(bodies):
        got.append(read_packet(read))
        # What is left waits in memory: kazoo's loop is told the socket is ready.
        assert conn.handler.held is (ours if i + 1 < len(bodies) else None)
    assert got == bodies
    assert read.recvs == 1   # kazoo's own reads: two recv() calls a packet


def test_a_new_connection_never_reads_what_the_old_one_left(pairs: list) -> None:
    old, old_peer = pair(pairs)
    conn = Connection(old)
    read = _BufferedReads(conn, never, conn.handler)
    old_peer.sendall(packet(b"first") + packet(b"stale")[:6])   # a reply cut off mid-way
    assert read_packet(read) == b"first"
    assert conn.handler.held is old
    new, new_peer = pair(pairs)
    conn._socket = new   # kazoo reconnected
    new_peer.sendall(packet(b"connect response"))
    assert read_packet(read) == b"connect response"
    assert conn.handler.held is None


def test_a_packet_longer_than_one_read_is_put_together(pairs: list) -> None:
    ours, theirs = pair(pairs)
    conn = Connection(ours)
    read = _BufferedReads(conn, never, conn.handler)
    body = bytes(range(256)) * (3 * READ_SIZE // 256 + 7)
    sender = threading.Thread(target=theirs.sendall, args=(packet(body) + packet(b"next"),))
    sender.start()
    assert read_packet(read) == body
    assert read_packet(read) == b"next"
    sender.join()


def test_a_closed_peer_drops_the_connection_and_silence_times_out(pairs: list) -> None:
    ours, theirs = pair(pairs)
    conn = Connection(ours)
    read = _BufferedReads(conn, never, conn.handler)
    with pytest.raises(conn.handler.timeout_exception):
        read(4, 0.05)
    theirs.sendall(b"\x00\x00")   # half a length, then the peer goes
    theirs.close()
    with pytest.raises(ConnectionDropped):
        read(4, 1.0)


def test_tls_sockets_keep_kazoos_read(pairs: list) -> None:
    """The SSL layer holds decrypted bytes of its own (``pending()``)."""
    class TLSLike:
        def pending(self) -> int:
            return 0
    calls: list[int] = []

    def kazoos(length: int, timeout: float) -> bytes:
        calls.append(length)
        return b"x" * length
    conn = Connection(TLSLike())   # type: ignore[arg-type]
    read = _BufferedReads(conn, kazoos, conn.handler)
    assert read(3, 1.0) == b"xxx" and calls == [3]


def event(xid: int, body: bytes) -> bytes:
    """A packet with ZooKeeper's reply header (xid, zxid, err) and ``body``."""
    return packet(struct.pack("!iqi", xid, 7, 0) + body)


def test_watch_events_behind_one_are_taken_up_to_the_first_reply(pairs: list) -> None:
    a, b = pair(pairs)
    connection = Connection(a)
    read = _BufferedReads(connection, never, connection.handler)
    b.sendall(event(-1, b"first") + event(-1, b"second") + event(-1, b"third")
              + event(5, b"reply") + event(-1, b"after"))
    assert read_packet(read)[16:] == b"first"   # kazoo's loop reads one
    taken = read.watch_events(1)   # at most this many
    assert [p[16:] for p in taken] == [b"second"]
    assert [p[16:] for p in read.watch_events(64)] == [b"third"]   # not past the reply
    assert connection.handler.held is a   # the reply waits in the buffer
    assert read.watch_events(64) == []
    assert read_packet(read)[16:] == b"reply"
    assert [p[16:] for p in read.watch_events(64)] == [b"after"]
    assert connection.handler.held is None


def test_an_event_not_all_here_is_left_for_the_socket(pairs: list) -> None:
    a, b = pair(pairs)
    connection = Connection(a)
    read = _BufferedReads(connection, never, connection.handler)
    whole, partial = event(-1, b"whole"), event(-1, b"x" * 100)
    b.sendall(event(-1, b"first") + whole + partial[:20])
    assert read_packet(read)[16:] == b"first"
    assert [p[16:] for p in read.watch_events(64)] == [b"whole"]
    assert read.watch_events(64) == []
    b.sendall(partial[20:])
    assert read_packet(read)[16:] == b"x" * 100


def test_a_held_socket_is_readable_at_once_and_the_others_looked_at_now_and_then(
        pairs: list) -> None:
    """While packets wait in the buffer kazoo's loop must not wait on the
    socket; its request pipe is still looked at every HELD_PEEK packets."""
    ours, theirs = pair(pairs)
    pipe, pipe_peer = pair(pairs)   # kazoo's wake-up for requests to send
    handler = PollingHandler()
    handler.held = ours
    pipe_peer.sendall(b"w")
    answers = [handler.select([ours, pipe], [], [], 5) for _ in range(HELD_PEEK)]
    assert answers[:-1] == [([ours], [], [])] * (HELD_PEEK - 1)   # the socket itself is empty
    assert answers[-1] == ([ours, pipe], [], [])
    assert handler.select([ours], [pipe], [], 5) == ([ours], [pipe], [])   # writes: always
    handler.held = None
    assert handler.select([ours], [], [], 0) == ([], [], [])
