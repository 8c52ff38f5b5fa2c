"""The zk:// transport through kombu's API, against a real ZooKeeper."""
from __future__ import annotations

import gc
import json
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_zk.exceptions import MessageTooLarge, ZKConfigurationError, ZKConnectionError
from celery_zk.zk.layout import Layout
from celery_zk.zk.message_names import parse_bucket_name, parse_message_name

from .queues import first_bucket_path, owned, waiting
from .sessions import apart
from .spies import CONSUMER_REQUESTS, count_calls, count_multis
from .workers import wait_until

#: In every cell of the version matrix (tox.ini).
pytestmark = pytest.mark.matrix


@pytest.fixture
def conn(zk_url: str) -> Iterator[Connection]:
    with Connection(zk_url) as connection:
        connection.connect()
        yield connection


def drain(connection: Connection, queue: Queue, count: int, ack: bool = True,
          timeout: float = 10) -> list[Any]:
    got: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append((body, message))
        if ack:
            message.ack()

    with Consumer(connection, [queue], callbacks=[on_message], prefetch_count=count):
        deadline = time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            try:
                connection.drain_events(timeout=0.5)
            except socket.timeout:
                pass
    return got


def layout_of(zk_url: str) -> Layout:
    """Paths as the ``zk_client`` fixture sees them: it is chrooted at the URL's path."""
    return Layout("/")


def test_priority_order_higher_first_fifo_within(conn: Connection) -> None:
    queue = Queue("prio", Exchange("prio", "direct"), "prio")
    producer = Producer(conn.channel())
    sent = [(i, p) for i, p in enumerate([0, 5, 9, 5, 0, None, 9, 1])]
    for i, priority in sent:
        kwargs = {} if priority is None else {"priority": priority}
        producer.publish({"i": i}, exchange=queue.exchange, routing_key="prio",
                         declare=[queue], **kwargs)
    got = [body["i"] for body, _ in drain(conn, queue, len(sent))]
    assert got == [2, 6, 1, 3, 7, 0, 4, 5]


def test_requeue_goes_back_ahead_of_newer_messages(conn: Connection) -> None:
    queue = Queue("rq", Exchange("rq", "direct"), "rq")
    producer = Producer(conn.channel())
    for i in range(3):
        producer.publish({"i": i}, exchange=queue.exchange, routing_key="rq", declare=[queue])
    (body, message), = drain(conn, queue, 1, ack=False)
    assert body == {"i": 0}
    message.requeue()
    producer.publish({"i": 3}, exchange=queue.exchange, routing_key="rq")
    got = drain(conn, queue, 4)
    assert [b["i"] for b, _ in got] == [0, 1, 2, 3]
    assert got[0][1].delivery_info["redelivered"] is True


def test_reject_removes_or_dead_letters(zk_url: str, zk_client: KazooClient) -> None:
    layout = layout_of(zk_url)
    for dead_letter in (False, True):
        with Connection(zk_url, transport_options={"dead_letter_rejected": dead_letter}) as c:
            queue = Queue(f"rej{dead_letter}", Exchange("rej", "direct"), f"rej{dead_letter}")
            Producer(c.channel()).publish({"x": 1}, exchange=queue.exchange,
                                          routing_key=queue.routing_key, declare=[queue])
            (_, message), = drain(c, queue, 1, ack=False)
            message.reject(requeue=False)
            name = queue.name
            assert waiting(zk_client, layout, name) == []
            assert owned(zk_client, layout, name) == []
            assert len(zk_client.get_children(layout.dead(name))) == (1 if dead_letter else 0)


def test_purge_size_and_delete(conn: Connection, zk_url: str, zk_client: KazooClient) -> None:
    queue = Queue("pq", Exchange("pq", "direct"), "pq")
    channel = conn.channel()
    producer = Producer(channel)
    for i in range(25):
        producer.publish({"i": i}, exchange=queue.exchange, routing_key="pq", declare=[queue])
    bound = queue(channel)
    assert bound.queue_declare(passive=True).message_count == 25
    assert bound.purge() == 25
    assert bound.queue_declare(passive=True).message_count == 0
    bound.delete()
    layout = layout_of(zk_url)
    assert zk_client.exists(layout.queue("pq")) is None
    assert zk_client.get_children(layout.bindings("pq")) == []


def test_fanout_and_topic_route_across_processes(zk_url: str, conn: Connection) -> None:
    """Bindings made here are seen by a publisher in another process."""
    fan = Exchange("bcast", "fanout")
    topic = Exchange("events", "topic")
    queues = [Queue("fan-a", fan), Queue("fan-b", fan),
              Queue("t-all", topic, "job.#"), Queue("t-done", topic, "job.*.done")]
    channel = conn.channel()
    for q in queues:
        q(channel).declare()
    script = f"""
import celery_zk
from kombu import Connection, Exchange, Producer
with Connection({zk_url!r}) as c:
    p = Producer(c.channel())
    p.publish({{'b': 1}}, exchange=Exchange('bcast', 'fanout'), routing_key='')
    p.publish({{'t': 'started'}}, exchange=Exchange('events', 'topic'), routing_key='job.1.started')
    p.publish({{'t': 'done'}}, exchange=Exchange('events', 'topic'), routing_key='job.1.done')
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert [b for b, _ in drain(conn, queues[0], 1)] == [{"b": 1}]
    assert [b for b, _ in drain(conn, queues[1], 1)] == [{"b": 1}]
    assert [b for b, _ in drain(conn, queues[2], 2)] == [{"t": "started"}, {"t": "done"}]
    assert [b for b, _ in drain(conn, queues[3], 1)] == [{"t": "done"}]


def test_auto_delete_bindings_die_with_the_session(zk_url: str, zk_client: KazooClient) -> None:
    layout = layout_of(zk_url)
    fan = Exchange("bc2", "fanout")
    with Connection(zk_url) as c:
        Queue("ephemeral-q", fan, auto_delete=True)(c.channel()).declare()
        assert zk_client.get_children(layout.bindings("bc2")) != []
    assert zk_client.get_children(layout.bindings("bc2")) == []
    assert zk_client.exists(layout.queue("ephemeral-q")) is None


def test_warm_close_requeues_unacked(zk_url: str, conn: Connection) -> None:
    queue = Queue("wc", Exchange("wc", "direct"), "wc")
    Producer(conn.channel()).publish({"x": 1}, exchange=queue.exchange, routing_key="wc",
                                     declare=[queue])
    with Connection(zk_url) as other:
        got = drain(other, queue, 1, ack=False)
        assert len(got) == 1
    # closing `other` without acking put it back
    assert [b for b, _ in drain(conn, queue, 1)] == [{"x": 1}]


def test_cancelling_a_consumer_gives_back_what_it_claimed_but_did_not_deliver(
        zk_url: str, conn: Connection, zk_client: KazooClient) -> None:
    layout = layout_of(zk_url)
    queue = Queue("cc", Exchange("cc", "direct"), "cc")
    producer = Producer(conn.channel())
    for n in range(3):
        producer.publish({"n": n}, exchange=queue.exchange, routing_key="cc", declare=[queue])
    with Connection(zk_url) as other:
        got: list[Any] = []
        consumer = Consumer(other, [queue], callbacks=[lambda b, m: got.append((b, m))],
                            prefetch_count=3)
        consumer.consume()
        other.drain_events(timeout=5)   # claims all three, delivers one
        assert len(got) == 1 and len(owned(zk_client, layout, "cc")) == 3
        consumer.cancel()
        # The two claimed but undelivered are waiting again; the delivered one stays owned.
        assert len(waiting(zk_client, layout, "cc")) == 2
        assert len(owned(zk_client, layout, "cc")) == 1
        got[0][1].ack()
    assert sorted(b["n"] for b, _ in drain(conn, queue, 2)) == sorted(
        {0, 1, 2} - {got[0][0]["n"]})


def test_dead_owner_is_recovered_and_cannot_ack(zk_url: str, zk_client: KazooClient) -> None:
    """SIGKILL a consumer holding a message: a survivor gets it back, the dead one's ack fails."""
    layout = layout_of(zk_url)
    queue = Queue("dead", Exchange("dead", "direct"), "dead")
    url = zk_url + "?session_timeout=4"   # the least a server with default tickTime grants
    script = f"""
import json, sys, time, celery_zk
from kombu import Connection, Consumer, Exchange, Queue
c = Connection({url!r})
q = Queue('dead', Exchange('dead', 'direct'), 'dead')
def on_message(body, message):
    print(json.dumps([message.delivery_tag, c.transport.session.node_path]), flush=True)
with Consumer(c, [q], callbacks=[on_message]):
    c.drain_events(timeout=20)
    time.sleep(60)
"""
    with Connection(url) as survivor:
        Producer(survivor.channel()).publish({"x": 1}, exchange=queue.exchange,
                                             routing_key="dead", declare=[queue])
        doomed = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert doomed.stdout is not None
            tag, dead_node = json.loads(doomed.stdout.readline())
            assert len(owned(zk_client, layout, "dead")) == 1
            got: list[Any] = []
            consumer = Consumer(survivor, [queue], callbacks=[lambda b, m: got.append((b, m))])
            consumer.consume()
            doomed.kill()  # no clean close: ZooKeeper notices when the session times out
            doomed.wait(10)
            killed = time.monotonic()
            while not got and time.monotonic() - killed < 15:
                try:
                    survivor.drain_events(timeout=0.5)
                except socket.timeout:
                    pass
            recovery = time.monotonic() - killed
            assert got and got[0][0] == {"x": 1}
            assert recovery < 4 + 2 + 1  # session timeout + 2 s (+1 s slack for the test)
            assert got[0][1].delivery_info["redelivered"] is True
            # The dead owner's late ack must not touch the survivor's claim.
            assert survivor.transport.acks.ack(tag, dead_node) is False
            assert len(owned(zk_client, layout, "dead")) == 1
            got[0][1].ack()  # asynchronous, as AMQP's basic.ack: it lands shortly
            deadline = time.monotonic() + 5
            while owned(zk_client, layout, "dead") and time.monotonic() < deadline:
                time.sleep(0.02)
            assert owned(zk_client, layout, "dead") == []
            consumer.cancel()
        finally:
            doomed.kill()
            doomed.wait(10)


def test_idle_consumer_sends_no_requests(conn: Connection, zk_url: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    queue = Queue("idle", Exchange("idle", "direct"), "idle")
    queue(conn.channel()).declare()
    calls = count_calls(monkeypatch, conn.transport.handle.client, *CONSUMER_REQUESTS)
    got: list[Any] = []
    with Consumer(conn, [queue], callbacks=[lambda b, m: (got.append(b), m.ack())]):
        with pytest.raises(socket.timeout):
            conn.drain_events(timeout=0.5)  # first look: lists once, arms the watch
        calls.clear()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            with pytest.raises(socket.timeout):
                conn.drain_events(timeout=0.5)
        assert calls == []  # idle: nothing but kazoo's own session pings
        with Connection(zk_url) as other:
            Producer(other.channel()).publish({"wake": 1}, exchange=queue.exchange,
                                              routing_key="idle")
        started = time.monotonic()
        conn.drain_events(timeout=5)
        assert got == [{"wake": 1}]
        assert time.monotonic() - started < 5


def test_foreign_and_undecodable_nodes_are_dead_lettered(conn: Connection, zk_url: str,
                                                        zk_client: KazooClient) -> None:
    layout = layout_of(zk_url)
    queue = Queue("junk", Exchange("junk", "direct"), "junk")
    producer = Producer(conn.channel())
    producer.publish({"ok": 1}, exchange=queue.exchange, routing_key="junk", declare=[queue])
    zk_client.create(layout.unowned("junk") + "/something-else", b"hello")
    # Inside a bucket: a name that is not a message, one of another bucket, and
    # a message whose body does not decode.
    bucket = first_bucket_path(zk_client, layout, "junk")
    zk_client.create(bucket + "/x-junk", b"hi")
    zk_client.create(bucket + "/n0-0000000077-0123456789abcdef-0000000001", b"")
    broken = f"n9-0000000000-{'ab' * 8}-0000000001"   # between the two published
    zk_client.create(layout.body("junk", parse_message_name(broken)), b"{not json")
    zk_client.create(f"{bucket}/{broken}")
    # A message stored by celery_zk before 0.2: left for `celery zk upgrade`.
    legacy = zk_client.create(layout.unowned("junk") + "/m0-0123456789abcdef-", b"{}",
                              sequence=True)
    producer.publish({"ok": 2}, exchange=queue.exchange, routing_key="junk")
    got = [b for b, _ in drain(conn, queue, 2)]
    assert got == [{"ok": 1}, {"ok": 2}]
    dead = zk_client.get_children(layout.dead("junk"))
    assert sorted(n.split("-")[0] for n in dead) == ["n9", "p9", "p9", "something"], dead
    assert waiting(zk_client, layout, "junk") == [legacy.rpartition("/")[2]]


def test_oversized_message_is_refused_before_writing(zk_url: str,
                                                     zk_client: KazooClient) -> None:
    queue = Queue("big", Exchange("big", "direct"), "big")
    conn = Connection(f"{zk_url}?max_message_size=1000000")
    producer = Producer(conn.channel())
    producer.publish({"small": 1}, exchange=queue.exchange, routing_key="big", declare=[queue])
    with pytest.raises(MessageTooLarge, match="max_message_size"):
        producer.publish({"blob": "x" * 2_000_000}, exchange=queue.exchange, routing_key="big")
    layout = layout_of(zk_url)
    assert len(waiting(zk_client, layout, "big")) == 1
    producer.publish({"small": 2}, exchange=queue.exchange, routing_key="big")  # still usable
    assert [b for b, _ in drain(conn, queue, 2)] == [{"small": 1}, {"small": 2}]
    conn.close()


def test_big_messages_are_claimed_in_requests_the_server_accepts(
        conn: Connection, zk_url: str) -> None:
    """Three messages of 400 KB, a prefetch of 3: one claim of all three would be a
    1.2 MB request, which ZooKeeper (jute.maxbuffer 1 MiB) answers by closing the
    connection, again on every retry. They come in claims that fit instead."""
    queue = Queue("bulky", Exchange("bulky", "direct"), "bulky")
    producer = Producer(conn.channel())
    for n in range(3):
        producer.publish({"n": n, "blob": "x" * 400_000}, exchange=queue.exchange,
                         routing_key="bulky", declare=[queue])
    with Connection(zk_url) as other:
        got = drain(other, queue, 3, timeout=20)
    assert [body["n"] for body, _ in got] == [0, 1, 2]


def test_bad_url_and_unreachable_server_fail_clearly() -> None:
    with pytest.raises(ZKConfigurationError, match="sesion_timeout"):
        Connection("zk://127.0.0.1:1/x?sesion_timeout=1").connect()
    # Nothing listens: said at once, not after the connect timeout (60 s here).
    started = time.monotonic()
    with pytest.raises(ZKConnectionError,
                       match="Could not connect to ZooKeeper at 127.0.0.1:1: connection refused"):
        Connection("zk://127.0.0.1:1/x?connect_timeout=60").transport.establish_connection()
    assert time.monotonic() - started < 30


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections and never answers (a hung server)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


@pytest.mark.parametrize(("url_option", "kombu_timeout", "used"), [
    ("", 2, "2s"),                        # kombu's (Celery's broker_connection_timeout)
    ("?connect_timeout=1", 60, "1s"),     # the URL's wins when given
])
def test_connect_timeout_comes_from_kombu_unless_given(
        silent_port: int, url_option: str, kombu_timeout: float, used: str) -> None:
    conn = Connection(f"zk://127.0.0.1:{silent_port}/x{url_option}",
                      connect_timeout=kombu_timeout)
    with pytest.raises(ZKConnectionError, match=f"no session within {used}"):
        conn.transport.establish_connection()


def test_stored_message_is_plain_json(conn: Connection, zk_url: str,
                                      zk_client: KazooClient) -> None:
    """Operators can read what is queued with zkCli."""
    queue = Queue("plain", Exchange("plain", "direct"), "plain")
    Producer(conn.channel()).publish({"a": 1}, exchange=queue.exchange, routing_key="plain",
                                     declare=[queue], priority=4)
    layout = layout_of(zk_url)
    (name,) = waiting(zk_client, layout, "plain")
    assert name.startswith("n5-")   # the name, empty; the body is stored apart, once
    message = parse_message_name(name)
    assert message is not None and not message.chunked
    assert zk_client.get(layout.unowned_message("plain", name))[0] == b""
    body = layout.body("plain", message)
    assert body is not None
    data, _ = zk_client.get(body)
    assert json.loads(data)["properties"]["priority"] == 4


def test_creates_whose_reply_was_lost_are_not_repeated(
        conn: Connection, zk_client: KazooClient, zk_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A publish or a registration that happened but lost its reply is found on
    the retry, not made twice."""
    from kazoo.exceptions import ConnectionLoss

    transport = conn.transport
    client = transport.handle.client
    real_create, real_transaction = client.create, client.transaction
    lost: list[str] = []

    def create_then_lose_reply(path: str, *args: Any, **kwargs: Any) -> str:
        made = real_create(path, *args, **kwargs)
        if len(lost) < 2 and parse_bucket_name(path.rpartition("/")[2]) is None:
            lost.append(made)   # the registration's first attempt
            raise ConnectionLoss()
        return made

    def transaction_losing_a_reply() -> Any:
        txn = real_transaction()
        real_commit = txn.commit

        def commit() -> Any:
            results = real_commit()
            if not lost and "/unowned/p" in str(results[-1]):
                # the first publish's multi: committed, its reply lost
                lost.append(results[-1])
                raise ConnectionLoss()
            return results
        txn.commit = commit
        return txn

    monkeypatch.setattr(client, "create", create_then_lose_reply)
    monkeypatch.setattr(client, "transaction", transaction_losing_a_reply)
    layout = layout_of(zk_url)
    transport.queues.declare("lossy")
    name = transport.publisher.put("lossy", b"{}", None)
    assert waiting(zk_client, layout, "lossy") == [name]
    message = parse_message_name(name)
    assert message is not None and zk_client.get_children(
        layout.parent(layout.body("lossy", message) or "")) == [message.uid]   # one body
    consumer_id, node = transport.session.ensure_registered()
    assert zk_client.get_children(layout.consumers) == [node.rpartition("/")[2]]
    assert len(lost) == 2 and lost[0].endswith(name) and lost[1] == node
    assert consumer_id in node


def test_a_read_of_a_body_whose_reply_was_lost_is_repeated(
        zk_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lost reply to a consumer's pipelined read of bodies (a multiRead) is
    read again, not a consumer restart."""
    from kazoo.exceptions import ConnectionLoss

    from celery_zk.zk import reads

    queue = Queue("lost-read", Exchange("lost-read", "direct"), "lost-read")
    with Connection(zk_url) as conn:
        client = conn.transport.handle.client
        producer = Producer(conn.channel())
        for i in range(3):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="lost-read",
                             declare=[queue])
        lost: list[str] = []

        def lose(result: Any, what: str) -> Any:
            if lost:
                return result
            lost.append(what)
            broken = client.handler.async_result()
            # It is answered; the reply goes missing on the way back. Not waited
            # for: an idle consumer's read is sent from kazoo's connection thread.
            result.rawlink(lambda _: broken.set_exception(ConnectionLoss()))
            return broken

        real_send = reads.kazoo_compat.send
        monkeypatch.setattr(reads.kazoo_compat, "send", lambda c, request: (
            lose(real_send(c, request), "multiRead") if isinstance(request, reads.MultiRead)
            else real_send(c, request)))
        got = drain(conn, queue, 3)
        assert lost == ["multiRead"] and [body["i"] for body, _ in got] == [0, 1, 2]


def test_a_worker_shutdown_stops_drain_events_waiting(
        zk_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery's synchronous loop sees a SIGTERM only when drain_events returns, and
    then calls it once more: both must return at once, not after their timeout."""
    from celery.signals import worker_shutting_down

    import celery_zk.broker.transport as transport_module
    import celery_zk.zk.background as release_module

    # The signal marks this whole process as shutting down; later tests run
    # in it too (a session cut off for 2 s would be given up: test_start_gate
    # failed so when it ran after this one).
    monkeypatch.setattr(transport_module, "_shutdowns", transport_module._shutdowns)
    monkeypatch.setattr(release_module, "_shutting_down", release_module._shutting_down)
    monkeypatch.setattr(release_module, "_busy", release_module._busy)
    queue = Queue("stopping", Exchange("stopping", "direct"), "stopping")
    with Connection(zk_url) as conn, Connection(zk_url) as other:
        queue(conn.channel()).declare()
        got: list[Any] = []
        with Consumer(conn, [queue], callbacks=[lambda b, m: (got.append(b), m.ack())]):
            outcome: dict[str, Any] = {}

            def wait() -> None:
                started = time.monotonic()
                try:
                    conn.drain_events(timeout=30)
                except socket.timeout:
                    outcome["waited"] = time.monotonic() - started

            waiter = threading.Thread(target=wait)
            waiter.start()
            time.sleep(0.5)   # blocked in drain_events
            # What Celery's SIGTERM handler sends (from the main thread; the wait is elsewhere).
            worker_shutting_down.send(sender="test", sig="SIGTERM", how="Warm", exitcode=0)
            waiter.join(10)
            assert not waiter.is_alive() and outcome["waited"] < 10
            Producer(other.channel()).publish("late", exchange=queue.exchange,
                                              routing_key="stopping")
            with pytest.raises(socket.timeout):   # the loop's last call: no wait, no delivery
                conn.drain_events(timeout=30)
        assert got == []
    # A connection made after the shutdown began waits and delivers as usual.
    with Connection(zk_url) as fresh:
        with Consumer(fresh, [queue], callbacks=[lambda b, m: (got.append(b), m.ack())]):
            fresh.drain_events(timeout=10)
    assert got == ["late"]


def test_a_property_json_cannot_carry_is_dropped_as_amqp_does(
        conn: Connection, caplog: pytest.LogCaptureFixture) -> None:
    """Producer.publish(**kwargs) makes every keyword a property; one that JSON
    cannot encode is dropped (py-amqp drops properties it has no field for)."""
    queue = Queue("props", Exchange("props", "direct"), "props")
    producer = Producer(conn.channel())
    producer.publish({"a": 1}, exchange=queue.exchange, routing_key="props", declare=[queue],
                     signal=object(), correlation_id="kept")
    [(body, message)] = drain(conn, queue, 1)
    assert body == {"a": 1}
    assert message.properties["correlation_id"] == "kept"
    assert "signal" not in message.properties
    assert "message property 'signal' dropped" in caplog.text
    with pytest.raises(TypeError, match="headers"):
        producer.publish({"b": 2}, exchange=queue.exchange, routing_key="props",
                         headers={"bad": object()})
    assert conn.default_channel._size("props") == 0   # nothing half-stored


def test_a_before_task_publish_handler_may_republish_with_its_kwargs(zk_url: str) -> None:
    """Celery's canvas suite republishes from before_task_publish with **kwargs,
    which carry the signal object."""
    from celery import Celery
    from celery.signals import before_task_publish

    app = Celery("republish", broker=zk_url, set_as_current=False)

    @app.task(name="republish.add")
    def add(x: int, y: int) -> int:
        return x + y

    def republish(body: Any = None, exchange: Any = None, routing_key: Any = None,
                  headers: Any = None, properties: Any = None, declare: Any = None,
                  retry_policy: Any = None, **kwargs: Any) -> None:
        before_task_publish.disconnect(republish)   # once
        with app.producer_pool.acquire(block=True) as producer:
            producer.publish(body, exchange=exchange, routing_key=routing_key,
                             retry=None, serializer="json", headers=headers, **kwargs)

    before_task_publish.connect(republish)
    try:
        add.delay(1, 2)
    finally:
        before_task_publish.disconnect(republish)
    with app.connection() as connection:
        assert connection.default_channel._size("celery") == 2
    app.close()


def test_a_publish_retry_policy_may_carry_kombus_callbacks(zk_url: str) -> None:
    """kombu copies a publish's ``retry_policy`` into the connection's transport
    options (``Producer.publish``); its ``Connection.ensure`` keywords (errback,
    on_revive, retry_errors) are kombu's, not unknown celery_zk options."""
    from celery import Celery

    app = Celery("retry-policy", broker=zk_url, set_as_current=False)
    policy = {"max_retries": 2, "interval_start": 0, "errback": lambda exc, interval: None,
              "on_revive": lambda channel: None, "retry_errors": (ConnectionError,)}
    try:
        app.send_task("retry.policy", retry_policy=policy)
        app.conf.task_publish_retry_policy = policy   # the same, as the app's default
        app.send_task("retry.policy")
        with app.connection() as connection:
            assert connection.default_channel._size("celery") == 2
    finally:
        app.close()


def test_acks_of_one_moment_go_in_one_multi(conn: Connection, zk_url: str,
                                             zk_client: KazooClient,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefetch's worth of acks is one transaction, not one each; one message
    gone meanwhile (requeued, purged) does not keep the others from being acked."""
    layout = layout_of(zk_url)
    queue = Queue("acks", Exchange("acks", "direct"), "acks")
    producer = Producer(conn.channel())
    for i in range(12):
        producer.publish({"i": i}, exchange=queue.exchange, routing_key="acks", declare=[queue])
    got = drain(conn, queue, 12, ack=False)
    assert len(got) == 12
    client = conn.transport.handle.client
    multis = count_multis(monkeypatch, client)
    _, owner, name = conn.transport.layout.split_owned_path(got[0][1].delivery_tag)
    zk_client.delete(layout.inbox_message("acks", owner, name))   # its body stays
    for _, message in got:
        message.ack()
    wait_until(lambda: owned(zk_client, layout, "acks") == [], timeout=5,
               interval=0.02, message="the acks did not land")
    # The batch (refused: one message was gone), then the other 11 one by one.
    assert multis == [1 + 2 * 12] + [3] * 11   # a check, then name and body each
    for i in range(12):
        producer.publish({"i": i}, exchange=queue.exchange, routing_key="acks")
    got = drain(conn, queue, 12, ack=False)
    multis.clear()
    for _, message in got:
        message.ack()
    wait_until(lambda: owned(zk_client, layout, "acks") == [], timeout=5,
               interval=0.02, message="the acks did not land")
    assert multis == [1 + 2 * 12]


def test_a_draining_consumer_gets_every_message_once_and_in_order(conn: Connection) -> None:
    """With a prefetch of 4, the dispatcher keeps 4 in the inbox; what is read
    from there is delivered once and in order."""
    queue = Queue("ahead", Exchange("ahead", "direct"), "ahead")
    producer = Producer(conn.channel())
    for i in range(40):
        producer.publish({"i": i}, exchange=queue.exchange, routing_key="ahead",
                         declare=[queue])
    got: list[Any] = []
    with Consumer(conn, [queue], callbacks=[lambda body, message: got.append((body, message))],
                  prefetch_count=4):
        deadline = time.monotonic() + 10
        while len(got) < 4 and time.monotonic() < deadline:
            conn.drain_events(timeout=1)
        inbox = conn.transport.inbox("ahead")
        assert len(inbox.taken) <= 4
        for _, message in got:
            message.ack()
        while len(got) < 40 and time.monotonic() < deadline:
            conn.drain_events(timeout=1)
            got[-1][1].ack()
    assert [body["i"] for body, _ in got] == list(range(40))

def test_two_consumers_claiming_without_waiting_deliver_each_message_once(
        zk_url: str) -> None:
    """A backlog drained by two connections at once, with claims in flight while
    the event loop goes on: claims that lose a race give their other names back,
    and every message is delivered exactly once."""
    queue = Queue("race", Exchange("race", "direct"), "race")
    with Connection(zk_url) as conn:
        producer = Producer(conn.channel())
        for i in range(300):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="race",
                             declare=[queue])
    seen: list[int] = []
    lock = threading.Lock()

    def consume() -> None:
        with Connection(zk_url) as connection:
            def on_message(body: Any, message: Any) -> None:
                with lock:
                    seen.append(body["i"])
                message.ack()
            with Consumer(connection, [queue], callbacks=[on_message], prefetch_count=8):
                deadline = time.monotonic() + 30
                while len(seen) < 300 and time.monotonic() < deadline:
                    try:
                        connection.drain_events(timeout=0.5)
                    except socket.timeout:
                        pass

    threads = [threading.Thread(target=consume) for _ in range(2)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    counts = Counter(seen)
    missing = sorted(set(range(300)) - set(counts))
    twice = sorted(i for i, n in counts.items() if n > 1)
    assert (missing, twice) == ([], []), (
        f"after {time.monotonic() - started:.1f} s: never delivered {missing}, "
        f"delivered more than once {twice}")


def test_a_closing_connection_sends_its_held_acks_before_it_deletes_its_node(
        zk_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Held-back acks go through the session's Deferred, whose flush takes
    what is pending under its lock and sends it outside. A flush on another
    thread (the background one, or another connection's close) that took a
    connection's ack send and had not made it yet when that connection
    closed: the close found nothing pending, deleted its consumer node, and
    the ack, sent after, was refused by the node's check. Recovery then gave
    the acked message to another consumer (the two-consumer race test saw
    one message twice so). The closing connection sends its own held acks."""
    # A connection closing flushes the session's held acks, and one an earlier
    # test left for the garbage collector closes when it is collected: now.
    gc.collect()
    queue = Queue("held", Exchange("held", "direct"), "held")
    with Connection(zk_url) as other:   # keeps the session (and recovery) alive
        other.connect()
        with Connection(zk_url) as conn:
            conn.connect()
            # What a flush on another thread does first: take what is held back.
            # Taken here as it is held (not from the Deferred later: any write
            # held back after it, an idle consumer's offer, sends everything held
            # within 5 ms, and matrix cells lost that race three times).
            deferred = conn.default_channel.connection.queues.deferred
            taken: list[Any] = []
            monkeypatch.setattr(deferred, "later", lambda send, delay=None: taken.append(send))
            Producer(conn.channel()).publish({"i": 1}, exchange=queue.exchange,
                                             routing_key="held", declare=[queue])
            assert [body for body, _ in drain(conn, queue, 1)] == [{"i": 1}]
            monkeypatch.undo()
            taken = [send for send in taken if getattr(send, "__name__", "") == "_send_acks"]
            assert taken, "the ack was not held back"
        for send in taken:   # ... and then, later, send it
            send()
        got = drain(other, queue, 1, timeout=3)
        assert [body for body, _ in got] == [], "an acked message was delivered again"


def test_kombus_failover_switch_keeps_the_zk_url(zk_url: str) -> None:
    """kombu's failover moves to the next of several ``;``-separated URLs with
    ``Connection.switch(url)``, which leaves a bare host in ``hostname`` (and,
    handed a URL from ``alt``, the masked password). The transport still finds
    the URLs and the real password: what it writes, a connection with the
    plain URL reads (the nodes' digest ACL names the real password)."""
    from urllib.parse import urlsplit

    from celery_zk.server import free_ports

    live = urlsplit(zk_url)
    dead_url = f"zk://alice:s3cret@127.0.0.1:{free_ports()[0]}{live.path}"
    live_url = f"zk://alice:s3cret@{live.netloc}{live.path}"
    queue = Queue("failover", Exchange("failover", "direct"), "failover")
    for switch_to in ("masked alternate", "next in kombu's cycle"):
        with Connection(f"{dead_url};{live_url}") as connection:
            if switch_to == "masked alternate":   # kombu's own failover test does this
                connection.switch(connection.alt[-1])
            else:                                 # what ensure_connection does
                connection.maybe_switch_next()
            assert (connection.transport_cls, connection.hostname) == ("zk", "127.0.0.1")
            connection.connect()
            Producer(connection.channel()).publish({"via": switch_to}, exchange=queue.exchange,
                                                   routing_key="failover", declare=[queue])
            shown = connection.info()
            assert "s3cret" not in json.dumps([shown["hostname"], shown["alternates"]])
        with Connection(live_url) as plain:
            assert [body for body, _ in drain(plain, queue, 1)] == [{"via": switch_to}]


def test_an_open_channel_has_the_kombu_internals_the_transport_reads(
        conn: Connection) -> None:
    from celery_zk.compat import kombu as kombu_compat

    channel = conn.channel()
    assert kombu_compat.missing(channel) == []


def test_a_no_ack_delete_lost_with_its_connection_is_done_again(
        conn: Connection, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A no-ack message is deleted without waiting for the reply. When that
    delete is lost with the connection, the consumer (whose session lives on)
    must send it again: else the message stays in its inbox for good (the
    nemesis found a broadcast so), and is delivered twice if the session ends."""
    from kazoo.exceptions import ConnectionLoss
    from kazoo.protocol.serialization import Delete

    transport = conn.transport
    client = transport.handle.client
    queue = Queue("no-ack-lost", Exchange("no-ack-lost", "direct"), "no-ack-lost")
    Producer(conn.channel()).publish({"i": 1}, exchange=queue.exchange,
                                     routing_key="no-ack-lost", declare=[queue])
    real_transaction = client.transaction
    lost: list[list[str]] = []

    def transaction() -> Any:
        txn = real_transaction()
        real_commit_async = txn.commit_async

        def commit_async() -> Any:
            paths = [op.path for op in txn.operations if isinstance(op, Delete)]
            if not lost and paths == [op.path for op in txn.operations] and any(
                    "/owned/" in path for path in paths):   # a delivered message's delete
                lost.append(paths)   # never sent: the connection dropped first
                broken = client.handler.async_result()
                broken.set_exception(ConnectionLoss())
                return broken
            return real_commit_async()
        txn.commit_async = commit_async
        return txn

    monkeypatch.setattr(client, "transaction", transaction)
    got: list[Any] = []
    with Consumer(conn, [queue], callbacks=[lambda body, message: got.append(body)],
                  no_ack=True):
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=0.5)
            except socket.timeout:
                pass
        assert got == [{"i": 1}] and lost
        wait_until(lambda: not owned(zk_client, layout_of("/"), "no-ack-lost"), 15,
                   message="the delivered no-ack message stayed in its consumer's inbox")


def test_declaring_what_exists_writes_nothing(zk_url: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker that starts declares its queues, exchanges and bindings, made
    long ago by its peers: looked up, not written again (a refused create is
    still a transaction every server logs and syncs)."""
    queue = Queue("declared", Exchange("declared", "topic"), "declared.#")
    with Connection(zk_url) as first:
        queue(first.channel()).declare()
    with Connection(apart(zk_url, "second")) as second:
        channel = second.channel()
        writes = count_calls(monkeypatch, second.transport.handle.client,
                             "create", "transaction", "set", "delete")
        queue(channel).declare()
        assert writes == []


def test_a_message_published_once_is_stored_once(zk_url: str) -> None:
    """ONCE_PROPERTY (a chord's body, B17): the publish makes its marker in its
    own multi, and a second publish with the same marker stores nothing. A
    marker for another ensemble, or another user, is ignored; none is stored
    with the message."""
    from celery_zk.zk.names import ONCE_PROPERTY

    queue = Queue("once", Exchange("once", type="direct"), routing_key="once")
    with Connection(zk_url) as conn:
        hosts = conn.transport.settings.hosts
        chords = conn.transport.layout.chords
        client = conn.transport.handle.client   # paths from the root, as the backend's
        client.ensure_path(f"{chords}/g1")
        producer = Producer(conn.default_channel)
        ours = {"hosts": hosts, "username": None, "path": f"{chords}/g1/~sent"}
        for n in range(2):
            producer.publish({"n": n}, exchange=queue.exchange, routing_key="once",
                             declare=[queue], **{ONCE_PROPERTY: dict(ours)})
        assert client.exists(f"{chords}/g1/~sent") is not None
        elsewhere = {**ours, "hosts": "elsewhere:2181", "path": f"{chords}/g1/~x"}
        someone = {**ours, "username": "someone", "path": f"{chords}/g1/~y"}
        for n, once in ((2, elsewhere), (3, someone)):
            producer.publish({"n": n}, exchange=queue.exchange, routing_key="once",
                             **{ONCE_PROPERTY: once})
        assert client.get_children(f"{chords}/g1") == ["~sent"]
        # A marker whose parent is gone guards nothing: the message is stored.
        producer.publish({"n": 4}, exchange=queue.exchange, routing_key="once",
                         **{ONCE_PROPERTY: {**ours, "path": f"{chords}/gone/~sent"}})
        got = []
        simple = conn.SimpleQueue(queue)
        while True:
            try:
                message = simple.get(timeout=2)
            except simple.Empty:
                break
            got.append(message.payload["n"])
            assert ONCE_PROPERTY not in message.properties
            message.ack()
    assert got == [0, 2, 3, 4]


def test_unhonoured_queue_arguments_warn_once_and_the_queue_works(
        zk_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """x-dead-letter-exchange is not honoured yet: one warning per queue naming
    it, none for what is honoured (x-max-priority, x-max-length,
    x-max-length-bytes, x-message-ttl, x-expires), and the queue still works."""
    limited = Queue("limited", Exchange("limited", "direct"), "limited", max_length=10,
                    max_length_bytes=1000, max_priority=9, expires=3600,
                    queue_arguments={"x-message-ttl": 60000, "x-dead-letter-exchange": "dlx"})
    with Connection(zk_url) as conn:
        channel = conn.channel()
        with caplog.at_level("WARNING", logger="celery_zk"):
            limited(channel).declare()
            limited(conn.channel()).declare()   # a second channel, the same process
        warnings = [r.getMessage() for r in caplog.records if "does not honour" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "x-dead-letter-exchange, which" in warnings[0]
        for honoured in ("x-max-priority", "x-max-length", "x-message-ttl", "x-expires"):
            assert honoured not in warnings[0]
        Producer(channel).publish({"n": 1}, exchange=limited.exchange, routing_key="limited",
                                  declare=[limited])
        message = limited(channel).get(no_ack=True)
        assert message is not None and message.payload == {"n": 1}
        # kombu's remote control sets both on its auto-delete reply queues: they go
        # with the session, so nothing is said.
        caplog.clear()
        with caplog.at_level("WARNING", logger="celery_zk"):
            Queue("replies", Exchange("replies", "direct"), "replies", auto_delete=True,
                  expires=10, message_ttl=300)(channel).declare()
        assert not [r for r in caplog.records if "does not honour" in r.getMessage()]


def test_a_message_no_one_acks_goes_before_the_tasks_ready_with_it(
        conn: Connection, zk_url: str, zk_client: KazooClient) -> None:
    """A remote-control command (a queue consumed without acks) and a task ready
    at once: the command goes first, whichever channel kombu's round robin
    would look at first. Celery's own suite revokes by stamped header and then
    publishes the task; it ran, where the revoke and the task reached the
    worker's loop together."""
    tasks = Queue("ord-tasks", Exchange("ord-tasks", "direct"), "ord-tasks")
    control = Queue("ord-control", Exchange("ord-control", "direct"), "ord-control")
    got: list[str] = []
    layout = layout_of(zk_url)

    def on_task(body: Any, message: Any) -> None:
        got.append(body)
        message.ack()

    with Connection(apart(zk_url, "publisher")) as other, \
            Consumer(conn.channel(), [tasks], callbacks=[on_task]), \
            Consumer(conn.channel(), [control], no_ack=True,
                     callbacks=[lambda body, message: got.append(body)]):
        producer = Producer(other.channel())

        def publish(queue: Queue, body: str) -> None:
            producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key,
                             declare=[queue])

        def both_ready() -> None:
            wait_until(lambda: len(owned(zk_client, layout, "ord-tasks"))
                       + len(owned(zk_client, layout, "ord-control")) == 2, 10, 0.02,
                       "the two messages never reached the consumer's inboxes")
            # and this process heard of both (their watch events)
            wait_until(lambda: all(conn.transport.inbox(q).has_news
                                   for q in ("ord-tasks", "ord-control")), 10, 0.01,
                       "the consumer's watches never reported the two messages")

        # Each round leaves kombu's round robin where it began; the lone task
        # between the two rounds moves it on by one, so one round starts at each channel.
        for round_ in range(2):
            with pytest.raises(socket.timeout):
                conn.drain_events(timeout=0.3)   # consuming, idle
            publish(tasks, f"task {round_}")
            publish(control, f"control {round_}")
            both_ready()
            conn.drain_events(timeout=5)
            conn.drain_events(timeout=5)
            assert got[-2:] == [f"control {round_}", f"task {round_}"]
            if round_ == 0:
                publish(tasks, "lone")
                conn.drain_events(timeout=5)
        assert got == ["control 0", "task 0", "lone", "control 1", "task 1"]
