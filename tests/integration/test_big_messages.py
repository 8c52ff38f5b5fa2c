"""Messages bigger than one znode (issue 28, the broker's half): chunks written
before the message is visible, names that move alone, acks, drops, purges,
dead letters and recovery of the whole message, orphans collected. Real
ZooKeeper, and real workers for the end-to-end shapes."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_zk.broker import big
from celery_zk.exceptions import MessageTooLarge
from celery_zk.ops.dead_letters import DeadLetters
from celery_zk.zk.layout import Layout
from celery_zk.zk.message_names import parse_message_name
from celery_zk.zk.payload import is_manifest

from .big import text, wipe  # noqa: F401  (wipe: an autouse fixture)
from .queues import body_path, owned, waiting
from .workers import Worker, wait_until

MB = 1_000_000
LAYOUT = Layout("/")   # as the zk_client fixture sees it: chrooted at the URL's path


@pytest.fixture
def app(zk_url: str) -> Iterator[Celery]:
    client_app = Celery("bigmsg", broker=zk_url, backend=zk_url, set_as_current=False)
    yield client_app
    client_app.backend.close()
    client_app.close()


def digest(value: str) -> list[Any]:
    return [len(value), hashlib.sha256(value.encode()).hexdigest()]


def containers(zk_client: KazooClient, queue: str = "celery") -> list[str]:
    try:
        return zk_client.get_children(LAYOUT.chunks(queue))
    except Exception:
        return []


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_3_and_15_mb_arguments_through_workers(
        app: Celery, worker: Callable[..., Worker], zk_client: KazooClient, pool: str) -> None:
    """The two calls of the issue: a 3 MB argument, and a task returning 3 MB
    (results are chunked by the backend); and 15 MB each way."""
    worker(pool=pool, concurrency=2)
    small, large = text(3 * MB, 3), text(15 * MB, 15)
    calls = [app.send_task("proj.app.digests", args=([small],)),
             app.send_task("proj.app.digests", args=([large],)),
             app.send_task("proj.app.big_text", args=(3 * MB, 3)),
             app.send_task("proj.app.add", args=(2, 3))]
    assert calls[3].get(timeout=60) == 5
    assert calls[0].get(timeout=60) == [digest(small)]
    assert calls[1].get(timeout=120) == [digest(large)]
    assert calls[2].get(timeout=60) == small
    # Acked: names, bodies and chunks all gone.
    wait_until(lambda: containers(zk_client) == [] and owned(zk_client, LAYOUT, "celery") == [],
               10, message="a big message's chunks were left behind")


def test_one_byte_past_the_limit_is_refused_before_anything_is_written(
        zk_url: str, zk_client: KazooClient) -> None:
    queue = Queue("limit", Exchange("limit", "direct"), "limit")
    limit = 16 * 1024 * 1024
    with Connection(zk_url) as conn:
        publisher = conn.transport.publisher
        publisher.check_size(b"x" * limit, "exactly the limit")   # fits
        with pytest.raises(MessageTooLarge) as excinfo:
            publisher.check_size(b"x" * (limit + 1), "one byte more")
        message = str(excinfo.value)
        assert "16,777,217" in message and "16,777,216" in message
        assert "max_message_size" in message and "Nothing was written" in message
        # As a user meets it: at publish, before anything is stored.
        producer = Producer(conn.channel())
        producer.publish("x", exchange=queue.exchange, routing_key="limit", declare=[queue])
        with pytest.raises(MessageTooLarge):
            producer.publish("x" * (limit + 1), exchange=queue.exchange, routing_key="limit")
    assert len(waiting(zk_client, LAYOUT, "limit")) == 1 and containers(zk_client, "limit") == []


def test_a_big_message_moves_by_its_name_and_its_chunks_stay_put(
        zk_url: str, zk_client: KazooClient) -> None:
    queue = Queue("moves", Exchange("moves", "direct"), "moves")
    payload = text(2 * MB, 7)
    with Connection(f"{zk_url}?handoff=false") as conn:
        Producer(conn.channel()).publish(payload, exchange=queue.exchange,
                                         routing_key="moves", declare=[queue])
        (name,) = waiting(zk_client, LAYOUT, "moves")
        message = parse_message_name(name)
        assert message is not None and message.chunked and name.startswith("c")
        assert is_manifest(zk_client.get(body_path(LAYOUT, "moves", name))[0])
        (container,) = containers(zk_client, "moves")
        chunks = zk_client.get_children(LAYOUT.chunk_container("moves", container))
        assert len(chunks) >= len(payload) // (128 * 1024)
        before = {c: zk_client.exists(f"{LAYOUT.chunk_container('moves', container)}/{c}").czxid
                  for c in chunks}
        got: list[Any] = []
        with Consumer(conn, [queue], prefetch_count=1,
                      callbacks=[lambda body, m: got.append((body, m))]):
            conn.drain_events(timeout=20)
            assert got[0][0] == payload
            assert {c: zk_client.exists(
                f"{LAYOUT.chunk_container('moves', container)}/{c}").czxid
                for c in chunks} == before   # given, never copied
            got[0][1].requeue()   # back by its name; the chunks stay
            conn.drain_events(timeout=20)
            assert got[1][0] == payload and got[1][1].delivery_info.get("redelivered")
            got[1][1].ack()
            wait_until(lambda: containers(zk_client, "moves") == [], 10,
                       message="the ack left the chunks")


def test_a_dead_lettered_big_message_is_requeued_whole_and_purged_whole(
        zk_url: str, zk_client: KazooClient) -> None:
    queue = Queue("dlq", Exchange("dlq", "direct"), "dlq")
    payload = text(MB, 3)
    with Connection(f"{zk_url}?dead_letter_rejected=true&handoff=false") as conn:
        producer = Producer(conn.channel())
        for _ in range(2):
            producer.publish(payload, exchange=queue.exchange, routing_key="dlq",
                             declare=[queue])
        got: list[Any] = []
        with Consumer(conn, [queue], prefetch_count=2,
                      callbacks=[lambda body, m: (got.append(body), m.reject())]):
            while len(got) < 2:
                conn.drain_events(timeout=20)
        letters = DeadLetters(conn.transport.queues, "dlq")
        wait_until(lambda: len(letters.ids()) == 2, 10)
        sizes = [letter.size for letter in letters.list()]   # as stored (base64)
        assert len(set(sizes)) == 1 and sizes[0] > len(payload)
        # The sweep leaves a dead letter's chunks alone, whatever their age.
        assert big.sweep(conn.transport.handle.client, conn.transport.layout, "dlq",
                         now=time.time() + 2 * big.ORPHAN_AGE) == 0
        letters.requeue(letters.ids()[0])
        again: list[Any] = []
        with Consumer(conn, [queue], callbacks=[lambda body, m: (again.append(body),
                                                                   m.ack())]):
            conn.drain_events(timeout=20)
        assert again == [payload]
        assert letters.purge() == 1
    wait_until(lambda: containers(zk_client, "dlq") == [], 10,
               message="purge or the ack left chunks")


def test_purge_deletes_big_messages_whole(zk_url: str, zk_client: KazooClient) -> None:
    queue = Queue("purge", Exchange("purge", "direct"), "purge")
    with Connection(zk_url) as conn:
        producer = Producer(conn.channel())
        for i in range(3):
            producer.publish(text(MB // 2, i), exchange=queue.exchange, routing_key="purge",
                             declare=[queue])
        producer.publish("small", exchange=queue.exchange, routing_key="purge")
        assert conn.default_channel.queue_purge("purge") == 4
    assert waiting(zk_client, LAYOUT, "purge") == [] and containers(zk_client, "purge") == []


PUBLISHER_DIES = """
import os, signal, sys
from kazoo.client import KazooClient
from kombu import Connection, Exchange, Producer, Queue

real = KazooClient.create_async
made = []

def create_or_die(self, path, *args, **kwargs):
    if "/chunks/" in path and path.rsplit("/", 1)[1].startswith("c"):
        made.append(path)
        if len(made) == 4:   # three chunks stored: killed writing the fourth
            import time
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
    return real(self, path, *args, **kwargs)

KazooClient.create_async = create_or_die
queue = Queue("orphans", Exchange("orphans", "direct"), "orphans")
with Connection(sys.argv[1]) as conn:
    Producer(conn.channel()).publish("x" * 3_000_000, exchange=queue.exchange,
                                     routing_key="orphans", declare=[queue])
"""


def test_a_publisher_killed_between_chunks_leaves_nothing_for_good(
        zk_url: str, zk_client: KazooClient) -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(PUBLISHER_DIES), zk_url],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    (orphan,) = containers(zk_client, "orphans")
    assert 1 <= len(zk_client.get_children(LAYOUT.chunk_container("orphans", orphan))) <= 3
    assert waiting(zk_client, LAYOUT, "orphans") == []   # never visible
    with Connection(zk_url) as conn:
        client = conn.transport.handle.client
        # Too young: it might still be being written.
        assert big.sweep(client, conn.transport.layout, "orphans") == 0
        assert big.sweep(client, conn.transport.layout, "orphans",
                         now=time.time() + big.ORPHAN_AGE + 1) == 1
        # A live big message is never taken for an orphan.
        queue = Queue("orphans", Exchange("orphans", "direct"), "orphans")
        Producer(conn.channel()).publish("y" * 300_000, exchange=queue.exchange,
                                         routing_key="orphans")
        assert big.sweep(client, conn.transport.layout, "orphans",
                         now=time.time() + 2 * big.ORPHAN_AGE) == 0
    assert len(containers(zk_client, "orphans")) == 1


def test_a_big_ack_lands_before_the_connection_closes(
        zk_url: str, zk_client: KazooClient) -> None:
    """A big message's ack (chunks listed, then one multi, on a background thread)
    is checked against the consumer's node, which closing the connection deletes:
    closing right after the ack waits for it, or the message stayed owned with
    its chunks and nobody left to put it back."""
    queue = Queue("closing", Exchange("closing", "direct"), "closing")
    got: list[Any] = []
    for attempt in range(3):
        got.clear()
        with Connection(f"{zk_url}?handoff=false") as conn:
            Producer(conn.channel()).publish(text(3 * MB, attempt), exchange=queue.exchange,
                                             routing_key="closing", declare=[queue])
            with Consumer(conn, [queue], callbacks=[lambda body, m: (got.append(body),
                                                                       m.ack())]):
                conn.drain_events(timeout=20)
            assert len(got) == 1
        # Closed: the ack has landed (no waiting here).
        assert owned(zk_client, LAYOUT, "closing") == [], attempt
        assert containers(zk_client, "closing") == [], attempt


def test_a_big_message_of_a_killed_worker_is_recovered_whole(
        app: Celery, worker: Callable[..., Worker], zk_client: KazooClient,
        zk_url: str) -> None:
    """acks_late: the worker dies holding it; the recovery leader puts its name
    back, and the next worker runs the whole message."""
    payload = text(2 * MB, 11)
    doomed = worker(name="doomed", conf={"task_acks_late": True})
    result = app.send_task("proj.app.slow_digest", args=(payload, 30))
    wait_until(lambda: owned(zk_client, LAYOUT, "celery"), 30,
               message="the worker was never given the message")
    time.sleep(1)   # it is running
    doomed.kill()
    worker(name="survivor", conf={"task_acks_late": True}, env={"SLOW_DIGEST_FAST": "1"})
    assert result.get(timeout=120) == digest(payload)


def test_status_and_the_exporter_count_big_messages(zk_url: str) -> None:
    from celery_zk.ops.exporter import StatusCollector
    from celery_zk.ops.report import format_status
    from celery_zk.ops.status import collect

    queue = Queue("counted", Exchange("counted", "direct"), "counted")
    with Connection(zk_url) as conn:
        producer = Producer(conn.channel())
        for size in (MB, 2 * MB):
            producer.publish(text(size), exchange=queue.exchange, routing_key="counted",
                             declare=[queue])
        producer.publish("small", exchange=queue.exchange, routing_key="counted")
        transport = conn.transport
        status = collect(transport.handle.client, transport.layout,
                         transport.settings.hosts, queues=["counted"], health=False)
    (counted,) = status.queues
    assert counted.waiting_total == 3 and counted.chunked == 2
    # The stored message (kombu's envelope, the body base64): a third more.
    assert 3 * MB * 4 // 3 < counted.chunked_bytes < 3 * MB * 4 // 3 + 10_000
    assert "2 (" in format_status(status, "zk://x")
    metrics = {(s.name, s.labels.get("queue_name")): s.value
               for family in StatusCollector(lambda: status).collect() for s in family.samples}
    assert metrics[("celery_zk_queue_chunked", "counted")] == 2
    assert metrics[("celery_zk_queue_chunked_bytes", "counted")] == counted.chunked_bytes
