"""celery_zk.zk.handler.PollingHandler: select()'s results from one poll(), and a
server silent while a request waits taken for dead."""
from __future__ import annotations

import os
import resource
import socket
import time
from collections.abc import Iterator

import pytest
from kazoo.exceptions import ConnectionDropped

from celery_zk.zk.handler import PollingHandler


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


def test_a_server_silent_while_a_request_waits_is_dropped(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """kazoo pings only when it sends nothing: a busy client's dead connection
    is found by the time since its first unanswered write."""
    ours, _ = pair
    handler = PollingHandler(silence=0.06)
    assert handler.select([], [ours], [], 0) == ([], [ours], [])   # a request goes
    assert handler.select([ours], [], [], 0) == ([], [], [])      # not yet overdue
    time.sleep(0.1)
    assert handler.select([], [ours], [], 0)[1] == [ours]   # more writes: still the first's age
    started = time.monotonic()
    with pytest.raises(ConnectionDropped, match="no reply from the server for 0.1s"):
        handler.select([ours], [], [], 5)
    assert time.monotonic() - started < 1   # at once, no wait


def test_a_wait_ends_when_the_silence_falls_due(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, _ = pair
    handler = PollingHandler(silence=0.1)
    handler.select([], [ours], [], 0)
    started = time.monotonic()
    assert handler.select([ours], [], [], 5) == ([], [], [])   # woken when due ...
    assert time.monotonic() - started < 1
    with pytest.raises(ConnectionDropped):   # ... and the next look drops it
        handler.select([ours], [], [], 5)


def test_an_answer_that_came_meanwhile_resets_the_clock(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    handler = PollingHandler(silence=0.06)
    handler.select([], [ours], [], 0)
    time.sleep(0.1)
    theirs.sendall(b"late, but here")   # e.g. our own process was paused
    assert handler.select([ours], [], [], 0) == ([ours], [], [])
    assert handler.asked is None
    ours.recv(100)
    assert handler.select([ours], [], [], 0) == ([], [], [])


def test_an_idle_connection_is_never_taken_for_dead(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """Nothing asked, nothing owed: kazoo's own ping covers a quiet connection."""
    ours, _ = pair
    handler = PollingHandler(silence=0.06)
    time.sleep(0.1)
    assert handler.select([ours], [], [], 0) == ([], [], [])
    assert PollingHandler().select([], [ours], [], 0) == ([], [ours], [])   # no silence set
    time.sleep(0.01)
