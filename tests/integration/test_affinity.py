"""Data-affinity scheduling (celery_zk.features.affinity) on a real server, with kombu
consumers and real workers: keys in node names, holders by ephemeral nodes,
preference, the bounded wait, and priority over affinity."""
from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_zk import affinity
from celery_zk.exceptions import CeleryZKError
from celery_zk.features.affinity import AffinityKeyError
from celery_zk.zk.layout import Layout
from celery_zk.zk.message_names import affinity_token, parse_message_name

from .queues import waiting
from .sessions import expire
from .workers import Worker, read_log, run_example, wait_until

LAYOUT = Layout("/")   # zk_client is chrooted at the URL's path
OTHER_WORKER = "0123456789ab"   # a holder id that is not this process's worker


@contextmanager
def client_app(url: str) -> Iterator[Celery]:
    app = Celery("client", broker=url, set_as_current=False)
    try:
        yield app
    finally:
        app.close()


def held_elsewhere(zk_client: KazooClient, key: str) -> str:
    """Make ``key`` held by another worker: its holding node, ephemeral on zk_client."""
    path = LAYOUT.holding(affinity_token(key), OTHER_WORKER, 1)
    zk_client.create(path, ephemeral=True, makepath=True)
    return path


def publish(conn: Connection, queue: Queue, body: Any, key: str | None = None,
            priority: int | None = None) -> None:
    headers = {"zk_affinity": key} if key is not None else {}
    options = {"priority": priority} if priority is not None else {}
    Producer(conn.channel()).publish(body, exchange=queue.exchange, routing_key=queue.name,
                                     declare=[queue], headers=headers, **options)


def consume(conn: Connection, queue: Queue, count: int, timeout: float = 30
            ) -> list[tuple[Any, float]]:
    """(body, seconds since the consumer started) of ``count`` messages, acked."""
    got: list[tuple[Any, float]] = []
    started = time.monotonic()

    def on_message(body: Any, message: Any) -> None:
        got.append((body, time.monotonic() - started))
        message.ack()

    with Consumer(conn, [queue], callbacks=[on_message], prefetch_count=1):
        while len(got) < count and time.monotonic() - started < timeout:
            try:
                conn.drain_events(timeout=0.5)
            except socket.timeout:
                pass
    return got


@pytest.fixture
def held_here() -> Iterator[None]:
    yield
    affinity._held.clear()   # what this test process said it holds


def test_a_keyed_message_names_its_key_and_keeps_it_when_requeued(
        zk_url: str, zk_client: KazooClient) -> None:
    queue = Queue("named", Exchange("named", "direct"), "named")
    with Connection(zk_url) as conn:
        publish(conn, queue, {"i": 1}, key="s3://bucket/dataset 42")
        names = waiting(zk_client, LAYOUT, "named")
        assert len(names) == 1
        parsed = parse_message_name(names[0])
        assert parsed is not None and parsed.affinity == "s3:%2F%2Fbucket%2Fdataset 42"
        assert "@s3:%2F%2Fbucket%2Fdataset 42-" in names[0]   # readable in the tree
        with Consumer(conn, [queue], prefetch_count=1) as consumer:
            got: list[Any] = []
            consumer.register_callback(lambda body, message: got.append(message))
            conn.drain_events(timeout=10)
            got[0].requeue()
        (name,) = waiting(zk_client, LAYOUT, "named")
        parsed = parse_message_name(name)
        assert parsed is not None and parsed.requeued
        assert parsed.affinity == "s3:%2F%2Fbucket%2Fdataset 42"
        long_key = "warehouse/" + "x" * 80
        publish(conn, queue, {"i": 2}, key=long_key)
        assert {parse_message_name(n).affinity for n in waiting(zk_client, LAYOUT, "named")} == {
            "s3:%2F%2Fbucket%2Fdataset 42", affinity_token(long_key)}
        assert affinity_token(long_key).startswith("#")   # named by its hash


def test_keys_zookeeper_would_refuse_in_a_name_are_stored_and_held(
        zk_url: str, zk_client: KazooClient, held_here: None) -> None:
    """ZooKeeper refuses some code points in node names (C1 controls,
    surrogates, U+F000-U+F8FF, U+FFF0-U+FFFF): such keys go in escaped, on a
    real server, both as a message's name and as a holding."""
    keys = ["\x85", "\ud800", "\uf000", "\ufff0", "😀", "数据" * 30]
    queue = Queue("odd-keys", Exchange("odd-keys", "direct"), "odd-keys")
    with Connection(zk_url) as conn:
        for i, key in enumerate(keys):
            publish(conn, queue, {"i": i}, key=key)
        names = waiting(zk_client, LAYOUT, "odd-keys")
        assert sorted(parse_message_name(n).affinity for n in names) == sorted(
            affinity_token(k) for k in keys)
    with client_app(zk_url) as app:
        affinity.hold(*keys, app=app)
        holders = {name.partition("~")[0]
                   for shard in zk_client.get_children("affinity")
                   for name in zk_client.get_children(f"affinity/{shard}")}
        assert holders == {affinity_token(k) for k in keys}


def holdings(zk_client: KazooClient) -> dict[str, int]:
    """Holding node name -> the session that owns it."""
    found = {}
    for shard in zk_client.get_children("affinity"):
        for name in zk_client.get_children(f"affinity/{shard}"):
            stat = zk_client.exists(f"affinity/{shard}/{name}")
            if stat is not None:
                found[name] = stat.ephemeralOwner
    return found


def test_a_process_that_only_holds_states_its_keys_again_after_a_session_expiry(
        zk_url: str, zk_client: KazooClient, held_here: None) -> None:
    """A prefork child runs tasks and consumes nothing: nobody else would
    notice that its session expired and took its holdings with it."""
    with client_app(zk_url) as app:
        affinity.hold("dataset-1", "dataset-2", app=app)
        before = holdings(zk_client)
        assert sorted(n.partition("~")[0] for n in before) == ["dataset-1", "dataset-2"]
        with app.pool.acquire(block=True) as connection:
            client = connection.transport.affinity.session.client
        def session() -> int | None:   # None while reconnecting
            return client.client_id[0] if client.client_id else None

        old_session = session()
        expire(client)
        wait_until(lambda: session() not in (None, old_session), 30,
                   message="the client never got a new session")
        wait_until(lambda: sorted(holdings(zk_client).values()) == [session()] * 2,
                   30, message=f"holdings not stated again: {holdings(zk_client)}")
        assert holdings(zk_client).keys() == before.keys()
        assert affinity.held() == {"dataset-1", "dataset-2"}


def test_holding_on_a_broker_that_is_not_zk_says_so_and_holds_nothing(
        held_here: None) -> None:
    app = Celery("other", broker="memory://", set_as_current=False)
    with pytest.raises(CeleryZKError, match="broker must be zk://"):
        affinity.hold("dataset-1", app=app)
    assert affinity.held() == frozenset()


@pytest.mark.parametrize("key", [["a list"], "", True, {"k": 1}])
def test_a_bad_key_fails_the_publish_clearly_and_writes_nothing(
        zk_url: str, zk_client: KazooClient, key: Any) -> None:
    with client_app(zk_url) as app:
        app.send_task("proj.app.record", args=(0,))   # the queue exists, with one message
        with pytest.raises(AffinityKeyError, match="affinity key") as raised:
            app.send_task("proj.app.record", args=(1,), headers={"zk_affinity": key})
        assert "Nothing was written" in str(raised.value)
    assert len(waiting(zk_client, LAYOUT, "celery")) == 1


def test_a_message_held_elsewhere_waits_for_its_holder_then_anyone_takes_it(
        zk_url: str, zk_client: KazooClient) -> None:
    held_elsewhere(zk_client, "theirs")
    queue = Queue("wait", Exchange("wait", "direct"), "wait")
    with Connection(zk_url + "?locality_wait=1.5") as conn:
        publish(conn, queue, "theirs-1", key="theirs")
        publish(conn, queue, "nobodys", key="nobody holds this")
        publish(conn, queue, "plain")
        publish(conn, queue, "theirs-2", key="theirs")
        got = consume(conn, queue, 4)
    assert [body for body, _ in got] == ["plain", "nobodys", "theirs-1", "theirs-2"]
    # A key nobody holds is taken at once; one held elsewhere after the wait, not forever.
    assert got[2][1] >= 1.5 - 0.1


def test_a_consumer_takes_the_keys_its_worker_holds_first(
        zk_url: str, zk_client: KazooClient, held_here: None) -> None:
    held_elsewhere(zk_client, "theirs")
    queue = Queue("mine", Exchange("mine", "direct"), "mine")
    with client_app(zk_url) as app:
        affinity.hold("mine", app=app)
        assert affinity.held() == {"mine"}
    assert zk_client.get_children(LAYOUT.parent(LAYOUT.holding("mine", affinity.WORKER, 1)))
    # lookahead=1: the dispatcher's choices, one at a time. A deep inbox (the
    # lookahead) delivers what it was given in one round in the queue's order
    # (features.md), which put nobodys-0 before mine-2 in one CI run.
    with Connection(zk_url + "?locality_wait=60&lookahead=1") as conn:
        for i in range(3):
            publish(conn, queue, f"nobodys-{i}", key=f"free-{i}")
            publish(conn, queue, f"mine-{i}", key="mine")
        got = consume(conn, queue, 6)
    assert [body for body, _ in got] == [
        "mine-0", "mine-1", "mine-2", "nobodys-0", "nobodys-1", "nobodys-2"]


@pytest.mark.parametrize("head", ["nobody holds this", "theirs"])
def test_the_oldest_message_is_not_starved_by_a_steady_stream_of_local_work(
        zk_url: str, zk_client: KazooClient, held_here: None, head: str) -> None:
    """A consumer that always has a held key's message to take still takes
    the oldest message once it has been the oldest for locality_wait: a key
    nobody holds gets loaded, and one whose holder does not come runs here."""
    held_elsewhere(zk_client, "theirs")
    queue = Queue("steady", Exchange("steady", "direct"), "steady")
    with client_app(zk_url) as app:
        affinity.hold("mine", app=app)
    with Connection(zk_url + "?locality_wait=1") as conn:
        publish(conn, queue, "oldest", key=head)
        for i in range(40):
            publish(conn, queue, f"mine-{i}", key="mine")
        got: list[tuple[Any, float]] = []
        started = time.monotonic()

        def on_message(body: Any, message: Any) -> None:
            got.append((body, time.monotonic() - started))
            time.sleep(0.1)   # 40 held messages: about 4 s of local work
            message.ack()

        with Consumer(conn, [queue], callbacks=[on_message], prefetch_count=1):
            while len(got) < 41 and time.monotonic() - started < 60:
                try:
                    conn.drain_events(timeout=0.5)
                except socket.timeout:
                    pass
    order = [body for body, _ in got]
    assert sorted(order) == sorted(["oldest"] + [f"mine-{i}" for i in range(40)])
    at = order.index("oldest")
    # Taken after about the wait, long before the local work ran out.
    assert 5 <= at < 30, order
    assert got[at][1] >= 1 - 0.1


def test_priority_wins_over_affinity(zk_url: str, zk_client: KazooClient,
                                     held_here: None) -> None:
    held_elsewhere(zk_client, "theirs")
    queue = Queue("prio-aff", Exchange("prio-aff", "direct"), "prio-aff",
                  queue_arguments={"x-max-priority": 9})
    with client_app(zk_url) as app:
        affinity.hold("mine", app=app)
    with Connection(zk_url + "?locality_wait=1") as conn:
        publish(conn, queue, "mine-low", key="mine", priority=1)
        publish(conn, queue, "theirs-high", key="theirs", priority=8)
        got = consume(conn, queue, 2)
    assert [body for body, _ in got] == ["theirs-high", "mine-low"]
    assert got[0][1] >= 1 - 0.1   # it waited for its holder, and the low one waited too


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_each_worker_runs_the_tasks_of_the_keys_it_holds_until_it_dies(
        zk_url: str, zk_client: KazooClient, start_worker: Callable[..., Worker],
        task_log: Path, pool: str) -> None:
    url = zk_url + "?locality_wait=600&session_timeout=4"
    a = start_worker(url, log=task_log, name="a", pool=pool, concurrency=1,
                     queues="celery,a")
    start_worker(url, log=task_log, name="b", concurrency=1, queues="celery,b")
    with client_app(url) as app:
        app.send_task("proj.app.hold_keys", args=(["k1"],), queue="a")
        app.send_task("proj.app.hold_keys", args=(["k2"],), queue="b")
        holders = LAYOUT.affinity
        wait_until(lambda: sorted(name.partition("~")[0] for shard in
                                  (zk_client.get_children(holders) if zk_client.exists(holders)
                                   else []) for name in
                                  zk_client.get_children(f"{holders}/{shard}")) == ["k1", "k2"],
                   30, message="both workers' holdings")
        for i in range(15):
            for key in ("k1", "k2"):
                app.send_task("proj.app.where_run", args=([key, i],),
                              headers={"zk_affinity": key})
        wait_until(lambda: len(ran(task_log)) == 30, 60, message="30 keyed tasks")
        by_key = {key: {host.partition("@")[0] for (k, _), host in ran(task_log) if k == key}
                  for key in ("k1", "k2")}
        assert by_key == {"k1": {"a"}, "k2": {"b"}}
        # a dies: ZooKeeper drops its holdings with its session, and k1 waits for nobody.
        a.kill()
        wait_until(lambda: not any(
            name.startswith("k1~") for shard in zk_client.get_children(holders)
            for name in zk_client.get_children(f"{holders}/{shard}")), 30,
            message="a's holdings to go with its session")
        for i in range(15, 20):
            app.send_task("proj.app.where_run", args=(["k1", i],), headers={"zk_affinity": "k1"})
        # locality_wait is 600 s: only "nobody holds k1" lets b take them now.
        wait_until(lambda: len(ran(task_log)) == 35, 60, message="k1 tasks on b")
        assert {host.partition("@")[0] for (k, i), host in ran(task_log) if i >= 15} == {"b"}


def ran(task_log: Path) -> list[tuple[tuple[str, int], str]]:
    if not task_log.exists():
        return []
    return [(tuple(entry["value"][0]), entry["value"][1]) for entry in read_log(task_log)
            if entry["kind"] == "where"]


def test_the_affinity_example_runs() -> None:
    proc = run_example("affinity")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "40 tasks," in proc.stdout
