"""celery_zk.zk.handler.PollingHandler: select()'s results from one poll()."""
from __future__ import annotations

import os
import resource
import socket
import time
from collections.abc import Iterator

import pytest

from celery_zk.zk.handler import HELD_PEEK, PollingHandler


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_reports_what_select_reports(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    handler = PollingHandler()
    assert handler.select([a], [], [], 0) == ([], [], [])
    assert handler.select([a], [b], [], 0) == ([], [b], [])   # nothing to read, room to write
    b.sendall(b"x")
    assert handler.select([a, b], [], [], 1) == ([a], [], [])
    assert handler.select([a.fileno()], [], [], 0) == ([a.fileno()], [], [])   # fds too
    b.close()
    a.recv(1)
    assert handler.select([a], [], [], 1)[0] == [a]   # closed: readable, the read says so


def test_waits_for_its_timeout_and_no_longer(pair: tuple[socket.socket, socket.socket]) -> None:
    a, _ = pair
    handler = PollingHandler()
    started = time.monotonic()
    assert handler.select([a], [], [], 0.05) == ([], [], [])
    assert 0.04 <= time.monotonic() - started < 2
    with pytest.raises(ValueError):
        handler.select([a], [], [], -1)
    with pytest.raises(TypeError):
        handler.select([a], [], [], "1")  # type: ignore[arg-type]


def test_descriptors_above_select_limit(pair: tuple[socket.socket, socket.socket]) -> None:
    """The reason kazoo left select(): a process with many files open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2100:
        pytest.skip("the hard limit of open files is below 2100")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2100), hard))
    a, b = pair
    high = os.dup2(a.fileno(), 2050)
    try:
        b.sendall(b"x")
        assert PollingHandler().select([high], [], [], 1) == ([high], [], [])
    finally:
        os.close(high)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_socket_with_bytes_held_in_a_buffer_is_readable_at_once(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """Packets read ahead (compat.kazoo.buffer_reads) wait in memory: kazoo's
    loop must not sleep on a socket whose bytes were taken already."""
    a, b = pair
    handler = PollingHandler()
    handler.held = a
    started = time.monotonic()
    assert handler.select([a, b], [], [], 5) == ([a], [], [])
    assert time.monotonic() - started < 1
    a.sendall(b"y")   # b readable too: reported, after the held one, within HELD_PEEK looks
    looks = [handler.select([a, b], [], [], 5) for _ in range(HELD_PEEK)]
    assert all(readable[0] is a for readable, _, _ in looks)
    assert ([a, b], [], []) in looks
    # Not every look: a burst of buffered packets costs no poll() each.
    assert ([a], [], []) in looks
    handler.held = None   # the buffer drained: every look polls again
    assert handler.select([a, b], [], [], 5) == ([b], [], [])
    # The reader that fills the buffer asks about the socket itself.
    assert not handler.wait_readable(a, 0)
    b.sendall(b"x")
    assert handler.wait_readable(a, 0)


def test_a_held_socket_not_asked_about_is_not_reported(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    handler = PollingHandler()
    handler.held = a
    assert handler.select([b], [], [], 0) == ([], [], [])
