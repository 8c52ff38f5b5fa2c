"""One ZooKeeper session per process, counted where ZooKeeper counts: on the server.

ZooKeeper allows 60 connections per client IP unless ``maxClientCnxns`` says
otherwise, and the test server keeps that default. These tests count the
sessions each process holds (``cons`` mapped to pids through /proc).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient, KazooState
from kombu import Connection

from celery_zk.zk import session as zk_session
from celery_zk.zk.handler import PollingHandler
from celery_zk.zk.layout import Layout

from .sessions import count, process_tree, session_ports, sessions_by_pid
from .workers import HERE, Worker, read_log, wait_until


@pytest.fixture
def server_address(zookeeper_server: Any) -> tuple[str, int]:
    host, _, port = zookeeper_server.hosts.partition(":")
    return host, int(port)


class Script:
    """A Python process driven line by line: it prints a line, waits for one."""

    def __init__(self, source: str, env: dict[str, str] | None = None) -> None:
        import os

        full_env = dict(os.environ, PYTHONPATH=str(HERE), **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(source)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=full_env)

    def expect(self, line: str, timeout: float = 120) -> None:
        assert self.proc.stdout is not None
        got = self.proc.stdout.readline().strip()
        if got != line:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=timeout)
            raise AssertionError(f"expected {line!r}, got {got!r}; stderr:\n{err[-4000:]}")

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self) -> None:
        self.go()
        _, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err[-4000:]


@contextmanager
def script(source: str, env: dict[str, str] | None = None) -> Iterator[Script]:
    running = Script(source, env)
    try:
        yield running
    finally:
        if running.proc.poll() is None:
            running.proc.kill()
            running.proc.communicate()


DROPPED = """
import gc, sys, time
from kombu import Connection, Exchange, Producer, Queue

def use(url, i):
    conn = Connection(url)
    channel = conn.channel()
    work = Queue("work", Exchange("work"), "work")
    Producer(channel).publish({{"i": i}}, exchange="work", routing_key="work",
                              declare=[work])
    got = []
    consumer = conn.Consumer([work], callbacks=[lambda body, m: (got.append(body), m.ack())])
    consumer.consume()
    conn.drain_events(timeout=10)
    assert got == [{{"i": i}}], got
    # Done with the queue (a consumer left there would be given the next
    # connection's message, as RabbitMQ would prefetch it to it)
    consumer.cancel()
    # what a client's reply queue is: auto-delete, bound ephemerally
    reply = Queue(f"reply{{i}}", Exchange("reply", type="direct"), routing_key=f"r{{i}}",
                  auto_delete=True)
    reply(channel).declare()
    return conn

held = [use({url!r}, i) for i in range({n})]
print("holding", flush=True); sys.stdin.readline()
del held   # dropped, never closed
gc.collect()
time.sleep(0.2)   # writes held back or in flight (5 ms) keep their connection until sent
gc.collect()
print("dropped", flush=True); sys.stdin.readline()
"""


def test_dropped_connections_give_their_session_back(
        zk_url: str, server_address: tuple[str, int], zk_client: KazooClient) -> None:
    """Five Connections used and dropped without close(): one session while they
    live, none once they are collected, and nothing of theirs is left."""
    layout = Layout("/")
    with script(DROPPED.format(url=zk_url, n=5)) as proc:
        proc.expect("holding")
        assert sessions_by_pid(*server_address)[proc.proc.pid] == 1
        assert len(zk_client.get_children(layout.consumers)) == 5
        proc.go()
        proc.expect("dropped")
        wait_until(lambda: sessions_by_pid(*server_address)[proc.proc.pid] == 0, 20,
                   message="the dropped connections' session is still open")
        assert zk_client.get_children(layout.consumers) == []
        assert zk_client.get_children(layout.bindings("reply")) == []
        proc.finish()


BACKEND_DROPPED = """
import gc, sys, time
from celery import Celery, states

def use(url, i):
    app = Celery(f"dropped{{i}}", broker=url, backend=url, set_as_current=False)
    app.backend.store_result(f"t{{i}}", i, states.SUCCESS)
    assert app.AsyncResult(f"t{{i}}").get(timeout=10) == i   # waits on a watch
    return app

held = [use({url!r}, i) for i in range(3)]
print("holding", flush=True); sys.stdin.readline()
del held   # never closed
gc.collect()
time.sleep(0.2)
gc.collect()
print("dropped", flush=True); sys.stdin.readline()
"""


def test_dropped_result_backends_give_their_session_back(
        zk_url: str, server_address: tuple[str, int]) -> None:
    with script(BACKEND_DROPPED.format(url=zk_url)) as proc:
        proc.expect("holding")
        assert sessions_by_pid(*server_address)[proc.proc.pid] == 1
        proc.go()
        proc.expect("dropped")
        wait_until(lambda: sessions_by_pid(*server_address)[proc.proc.pid] == 0, 20,
                   message="the dropped backends' session is still open")
        proc.finish()


def test_connections_of_a_process_share_one_session_and_own_their_nodes(
        zk_url: str, zk_client: KazooClient) -> None:
    """Closing one connection deletes what it alone made (its consumer node, its
    holder of a shared auto-delete queue) and keeps the other's."""
    from kombu import Exchange, Queue

    reply = Queue("shared-reply", Exchange("shared-reply", type="direct"), "r",
                  auto_delete=True)
    # A session name of its own: a connection an earlier test left to the
    # garbage collector must not be counted as this test's session.
    url = zk_url + "?session_name=shared-by-two"
    first, second = Connection(url), Connection(url)
    key = zk_session.session_key(first.transport.settings)
    try:
        for conn in (first, second):
            reply(conn.channel()).declare()
            conn.transport.session.ensure_registered()
        assert first.transport.handle.client is second.transport.handle.client
        # its connection thread waits with one poll() (celery_zk.zk.handler)
        assert isinstance(first.transport.handle.client.handler, PollingHandler)
        layout = Layout("/")
        assert len(zk_client.get_children(layout.consumers)) == 2
        assert len(zk_client.get_children(layout.holders("shared-reply"))) == 2
        first.release()
        assert len(zk_client.get_children(layout.consumers)) == 1
        assert len(zk_client.get_children(layout.holders("shared-reply"))) == 1
        # the binding both made stays while the second holds it
        assert zk_client.get_children(layout.bindings("shared-reply")) == ["shared-reply,r"]
        assert second.transport.handle.client.connected
    finally:
        first.release()
        second.release()
    assert zk_client.exists(Layout("/").queue("shared-reply")) is None
    assert zk_client.get_children(Layout("/").bindings("shared-reply")) == []
    assert key not in {open_.key for open_ in zk_session.sessions()}   # the last one ended it


CLIENT = """
import gc, sys, time
from celery import group
from kombu import Connection
from proj.app import add, app

results = group(add.s(i, i) for i in range({tasks})).apply_async()
assert results.get(timeout=120) == [2 * i for i in range({tasks})]
for _ in range({dropped}):
    conn = Connection({url!r})
    conn.default_channel.queue_declare("dropped-q")
    del conn
gc.collect()
time.sleep(0.2)
gc.collect()
assert add.delay(1, 2).get(timeout=30) == 3
print("done", flush=True); sys.stdin.readline()
"""


@pytest.mark.slow
def test_a_prefork_worker_and_a_client_stay_within_a_few_sessions(
        zk_url: str, server_address: tuple[str, int],
        start_worker: Callable[..., Worker]) -> None:
    """ZooKeeper's default cap is 60 connections per client IP: a prefork worker
    -c 4 holds at most 5 sessions (one per process), and a client one, after
    1,000 tasks with results and 50 Connections dropped without close()."""
    worker = start_worker(zk_url, backend=zk_url, pool="prefork", concurrency=4)
    env = {"CELERY_ZK_TEST_BROKER": zk_url, "CELERY_ZK_TEST_BACKEND": zk_url}
    with script(CLIENT.format(url=zk_url, tasks=1000, dropped=50), env) as client:
        client.expect("done", timeout=300)
        sessions = sessions_by_pid(*server_address)
        assert sessions[client.proc.pid] == 1, sessions
        worker_sessions = count(sessions, process_tree(worker.pid))
        assert 1 <= worker_sessions <= 5, (worker_sessions, sessions)
        client.finish()


@pytest.mark.slow
@pytest.mark.parametrize("rate_limited", [False, True], ids=["no-limits", "rate-limit"])
def test_a_prefork_child_makes_a_session_only_for_a_rate_limit(
        zk_url: str, server_address: tuple[str, int],
        start_worker: Callable[..., Worker], task_log: Any, rate_limited: bool) -> None:
    """Without a ``zk://`` result backend a prefork child needs ZooKeeper only
    to hold a rate limit as its task starts: a worker -c 3 holds one session
    (its parent's) when no rate limit applies, not one per child (the limits'
    start gate made one in each, up to ZooKeeper's cap of 60 per client IP on
    a host with many children), and its children make theirs when one does."""
    conf = {"zk_rate_limits": {"proj.app.timed": "50/s"}} if rate_limited else {}
    worker = start_worker(zk_url, log=task_log, pool="prefork", concurrency=3,
                          env={"CELERY_ZK_TEST_CONF": json.dumps(conf)})
    client = Celery("sessions", broker=zk_url, set_as_current=False)
    try:
        task = "proj.app.timed" if rate_limited else "proj.app.record"
        for i in range(30):
            client.send_task(task, args=(i,))
        kind = task.rpartition(".")[2]
        wait_until(lambda: sum(e["kind"] == kind for e in read_log(task_log)) == 30, 60,
                   message="not every task ran")
    finally:
        client.close()
    worker_sessions = count(sessions_by_pid(*server_address), process_tree(worker.pid))
    if rate_limited:
        assert worker_sessions > 1, worker_sessions
    else:
        assert worker_sessions == 1, worker_sessions


def test_a_forked_child_gets_its_own_session(zk_url: str,
                                             server_address: tuple[str, int]) -> None:
    """After fork() the child never uses (or closes) its parent's session."""
    import os

    with Connection(zk_url) as conn:
        conn.default_channel.queue_declare("before-fork")
        parent_client = conn.transport.handle.client
        to_parent, from_child = os.pipe()
        to_child, from_parent = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child: its own session, then leave without cleanup
            try:
                child_client = conn.transport.handle.client
                conn.default_channel.queue_declare("in-child")
                ok = child_client is not parent_client and child_client.connected
                port = child_client._connection._socket.getsockname()[1] if ok else 0
                os.write(from_child, f"{port:05d}".encode())
                os.read(to_child, 1)   # wait until the parent has looked
            finally:
                os._exit(0)
        try:
            child_port = int(os.read(to_parent, 5))
            parent_port = parent_client._connection._socket.getsockname()[1]
            assert child_port and child_port != parent_port
            assert {child_port, parent_port} <= set(session_ports(*server_address))
        finally:
            os.write(from_parent, b"x")
            os.waitpid(pid, 0)
        assert parent_client.connected   # the child did not end the parent's session
        conn.default_channel.queue_declare("after-fork")


def test_a_node_held_by_another_session_is_made_again_after_a_reconnect(
        zookeeper_server: Any, zk_chroot: str) -> None:
    """A restarted worker binds to its dead predecessor's pidbox node and
    watches it, to make its own when that session ends. A dropped connection
    drops the watch (kazoo re-sends none), so the end must still be noticed:
    the nemesis had a worker that never heard a broadcast again because its
    connection moved to another server between the two."""
    from celery_zk.zk.config import parse_url
    from celery_zk.zk.session import ClientHandle

    from .tcpproxy import TCPProxy

    path = f"{zk_chroot}/exchanges/celery.pidbox/bindings/same@host.celery.pidbox,%%"
    old = KazooClient(zookeeper_server.hosts)   # the killed predecessor's session
    old.start()
    host, port = zookeeper_server.hosts.rsplit(":", 1)
    try:
        old.create(path, ephemeral=True, makepath=True)
        with TCPProxy(host, int(port)) as proxy:
            handle = ClientHandle(parse_url(
                f"zk://{proxy.hosts}?session_timeout=10&session_name=held-{zk_chroot[-8:]}"))
            woken: list[bool] = []
            try:
                handle.hold(path)
                handle.session.held.on_reclaim_needed(lambda: woken.append(True))
                ours = handle.client.client_id[0]
                assert old.exists(path).ephemeralOwner != ours
                proxy.blackhole()
                wait_until(lambda: handle.client.state == KazooState.SUSPENDED, 20,
                           message="the client never noticed it was cut off")
                proxy.heal()   # within the session timeout: the same session
                wait_until(lambda: handle.client.state == KazooState.CONNECTED, 20,
                           message="the client never reconnected")
                assert handle.client.client_id[0] == ours
                wait_until(lambda: woken, 10, message="nobody was asked to look again")
                assert handle.session.held.reclaim() == []   # still the old session's: watched
                old.stop()   # that session ends: its node goes
                wait_until(lambda: handle.session.held.reclaim() == [path], 10,
                           message="the node was never made again")
                stat = KazooClient(zookeeper_server.hosts)
                stat.start()
                try:
                    assert stat.exists(path).ephemeralOwner == ours
                finally:
                    stat.stop()
                    stat.close()
            finally:
                handle.close()
    finally:
        old.stop()
        old.close()
