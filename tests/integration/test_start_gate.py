"""The start gate (celery_zk.worker.start_gate) on a real server, cut off by a
proxy: a start waits while the client cannot know whether its session lives,
goes ahead when the same session comes back, and is refused once it expired."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from kazoo.client import KazooState
from kombu import Connection

from celery_zk.worker.start_gate import StartGate, close_all, start_gate
from celery_zk.zk.config import parse_url
from celery_zk.zk.session import ClientHandle

from .sessions import expire
from .tcpproxy import TCPProxy
from .workers import wait_until


@contextmanager
def behind_a_proxy(zookeeper_server: Any, zk_chroot: str, name: str,
                   session_timeout: int) -> Iterator[tuple[TCPProxy, ClientHandle]]:
    """A connected handle whose connection goes through a proxy the test can cut."""
    host, port = zookeeper_server.hosts.rsplit(":", 1)
    with TCPProxy(host, int(port)) as proxy:
        # session_name: a session of its own, not one another test's handle shares
        handle = ClientHandle(parse_url(
            f"zk://{proxy.hosts}{zk_chroot}?session_timeout={session_timeout}"
            f"&session_name={name}-{zk_chroot[-8:]}"))
        handle.connect()
        try:
            yield proxy, handle
        finally:
            handle.close()


@pytest.fixture
def proxied(zookeeper_server: Any, zk_chroot: str) -> Iterator[tuple[TCPProxy, ClientHandle]]:
    with behind_a_proxy(zookeeper_server, zk_chroot, "gate", session_timeout=4) as proxied:
        yield proxied


def _admit_in_a_thread(gate: StartGate, ticket: int | None) -> list[bool]:
    answer: list[bool] = []
    threading.Thread(target=lambda: answer.append(gate.admit(ticket)), daemon=True).start()
    return answer


def _cut(proxy: TCPProxy, handle: ClientHandle) -> None:
    proxy.blackhole()
    wait_until(lambda: handle.client.state == KazooState.SUSPENDED, 15,
               message="the client never noticed it was cut off")


def test_a_start_waits_while_cut_off_and_goes_ahead_when_the_session_comes_back(
        proxied: tuple[TCPProxy, ClientHandle]) -> None:
    proxy, handle = proxied
    gate = start_gate(handle.session)
    assert start_gate(handle.session) is gate   # one per session
    ticket = gate.ticket(None)
    assert ticket is not None and gate.admit(ticket)
    _cut(proxy, handle)
    answer = _admit_in_a_thread(gate, ticket)
    time.sleep(1.0)
    assert answer == []   # it waits: the session may live or not
    proxy.heal()          # back within the session timeout: the same session
    wait_until(lambda: answer, 15, message="the start never went ahead")
    assert answer == [True] and gate.ticket(None) == ticket


def test_a_start_under_a_session_that_expired_is_refused(
        proxied: tuple[TCPProxy, ClientHandle]) -> None:
    proxy, handle = proxied
    gate = start_gate(handle.session)
    ticket = gate.ticket(None)
    _cut(proxy, handle)
    answer = _admit_in_a_thread(gate, ticket)
    time.sleep(6)         # past the 4 s session: the ensemble ends it
    assert answer == []
    proxy.heal()
    wait_until(lambda: answer, 15, message="the start was never answered")
    assert answer == [False]
    wait_until(lambda: gate.ticket(None) is not None, 15, message="no new session")
    assert gate.ticket(None) != ticket and gate.admit(gate.ticket(None))


def test_a_start_after_a_pause_checks_its_session_first(
        proxied: tuple[TCPProxy, ClientHandle]) -> None:
    """A pause is what the monitor notices; the check is one round trip."""
    _, handle = proxied
    gate = start_gate(handle.session)
    ticket = gate.ticket(None)
    syncs: list[str] = []
    client = handle.client
    real = client.sync_async
    client.sync_async = lambda path: (syncs.append(path), real(path))[1]  # type: ignore[method-assign]
    try:
        assert gate.admit(ticket) and syncs == []
        gate.monitor.paused_at = time.monotonic()   # as the monitor's late tick sets it
        assert gate.admit(ticket) and len(syncs) == 1
        assert gate.admit(ticket) and len(syncs) == 1   # checked once per pause
    finally:
        del client.sync_async


def test_a_worker_shutting_down_waits_for_no_server(
        proxied: tuple[TCPProxy, ClientHandle]) -> None:
    """Celery's thread pool stops by waiting for its threads: one waiting for a
    server that may never come would hold the shutdown."""
    proxy, handle = proxied
    gate = start_gate(handle.session)
    ticket = gate.ticket(None)
    _cut(proxy, handle)
    answer = _admit_in_a_thread(gate, ticket)
    time.sleep(0.5)
    assert answer == []
    close_all()   # worker_shutting_down
    wait_until(lambda: answer, 5, message="the start still waits")
    assert answer == [False]


def test_a_message_is_judged_by_the_session_it_was_delivered_under(zk_url: str) -> None:
    """Not by the session when it is handed to the pool: Celery may hand over a
    task it received before a session loss it has not heard of yet (a countdown
    coming due), after the client already has a new session (the nemesis saw
    a revoked one run so)."""
    with Connection(zk_url) as conn:
        queue = conn.SimpleQueue("gated")
        queue.put({"n": 1})
        message = queue.get(timeout=10)
        tag = message.delivery_tag
        gate = start_gate(conn.transport.handle.session)
        client = conn.transport.handle.client
        old = gate.ticket(tag)
        assert old == client.client_id[0] and gate.admit(old)
        assert gate.ticket("not-an-inbox-path") == old   # not ours: the session now
        expire(client)
        # kazoo sets client_id a moment before it tells listeners (the gate) of
        # the new session: wait for the gate, not for the client
        wait_until(lambda: gate.ticket(None) not in (None, old), 30,
                   message="the gate never heard of a new session")
        assert gate.ticket(None) == client.client_id[0]   # a new session, known
        assert gate.ticket(tag) is None and not gate.admit(gate.ticket(tag))
        assert not gate.admit(old)


def test_a_start_rests_on_a_fresh_answer_from_the_server(
        zookeeper_server: Any, zk_chroot: str) -> None:
    """kazoo notices a silent partition only by a ping left unanswered (and a
    busy client sends none): a client cut off a moment ago still says
    CONNECTED. A start whose message was not read lately waits for a round
    trip, which comes back only when the partition heals (the nemesis saw a
    countdown task start 7 s into a partition, after its revoke)."""
    # 10 s: kazoo would notice the cut only after 6.7 s (two thirds of it)
    with behind_a_proxy(zookeeper_server, zk_chroot, "fresh", session_timeout=10) as (
            proxy, handle):
        gate = start_gate(handle.session)
        ticket = gate.ticket(None)
        assert gate.admit(ticket, read_at=time.monotonic())   # just read: no round trip
        time.sleep(1.2)   # nothing heard from the server since
        proxy.blackhole()
        answer = _admit_in_a_thread(gate, ticket)
        time.sleep(1.0)
        assert handle.client.state == KazooState.CONNECTED   # kazoo has not noticed
        assert answer == []   # it waits for the server's answer
        proxy.heal()
        wait_until(lambda: answer, 15, message="the start was never answered")
        assert answer == [True]


def test_a_message_carries_when_its_body_was_read_not_when_it_was_delivered(
        zk_url: str) -> None:
    """A start gate counts the read of a task's message as a fresh answer from
    the server. A message that waits in the inbox after its read (a consumer
    looking ahead, a full prefetch) must not look fresher than it is: it
    carries when its read was sent."""
    from celery_zk.compat import celery_pool

    with Connection(zk_url) as conn:
        queue = conn.SimpleQueue("waited")
        for i in range(3):
            queue.put({"n": i})
        assert queue.get(timeout=10).payload == {"n": 0}
        inbox = conn.transport.inbox("waited")
        wait_until(lambda: (inbox.fill(1), len(inbox.buffer) == 2)[1], 10,
                   message="the other two were never read")
        read = time.monotonic()
        time.sleep(0.5)
        later = [queue.get(timeout=10) for _ in range(2)]
        assert [m.payload["n"] for m in later] == [1, 2]
        for message in later:
            assert message.properties[celery_pool.READ_AT] <= read
