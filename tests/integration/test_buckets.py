"""Buckets: a queue of any length on bounded directories, sequence counters that never run out.

Every test rolls to a new bucket every few messages (option ``bucket_size``),
as a long-running system does every 4,096.
"""
from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_zk.broker.queues import creates
from celery_zk.zk.layout import Layout
from celery_zk.zk.message_names import bucket_name, inverted, parse_bucket_name, parse_message_name

from .queues import buckets, waiting
from .spies import count_assignments
from .workers import wait_until

LAYOUT = Layout("/")   # zk_client is chrooted at the URL's path
SIZE = 5


def url(zk_url: str, name: str = "", size: int = SIZE) -> str:
    """A connection with small buckets; a session_name of its own makes it
    another process as far as ZooKeeper is concerned."""
    return f"{zk_url}?bucket_size={size}" + (f"&session_name={name}" if name else "")


def unowned_name(delivery_tag: str) -> str:
    """The waiting-message name a delivered message had (its tag is the owned
    path: ``owned/{consumer}/{name}``)."""
    name = delivery_tag.rpartition("/")[2]
    assert parse_message_name(name) is not None
    return name


def queue_of(name: str) -> Queue:
    return Queue(name, Exchange(name, "direct"), name)


def publish(connection: Connection, queue: Queue, bodies: list[Any],
            priorities: list[int | None] | None = None) -> None:
    producer = Producer(connection.channel())
    for body, priority in zip(bodies, priorities or [None] * len(bodies)):
        producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key,
                         declare=[queue], priority=priority)


def consume_all(connection: Connection, queue: Queue, count: int,
                timeout: float = 30) -> list[tuple[Any, str]]:
    """(body, unowned name) of ``count`` messages, one at a time, acked."""
    got: list[tuple[Any, str]] = []

    def on_message(body: Any, message: Any) -> None:
        got.append((body, unowned_name(message.delivery_tag)))
        message.ack()

    with Consumer(connection, [queue], callbacks=[on_message], prefetch_count=1):
        deadline = time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            try:
                connection.drain_events(timeout=0.5)
            except socket.timeout:
                pass
    return got


def largest_directory(zk_client: KazooClient, path: str = "/queues") -> tuple[int, str]:
    """(most children, where) of any directory under ``path``."""
    stat = zk_client.exists(path)
    best = (stat.numChildren, path)
    for child in zk_client.get_children(path):
        best = max(best, largest_directory(zk_client, f"{path.rstrip('/')}/{child}"))
    return best


@contextlib.contextmanager
def bucket_listings(connection: Connection) -> Iterator[list[int]]:
    """How many names each listing of a bucket through ``connection``'s client
    (the session its process's dispatcher uses) returned, while in the block."""
    listed: list[int] = []
    client = connection.transport.handle.client
    real = client.get_children

    def spy(path: str, *args: Any, **kwargs: Any) -> Any:
        names = real(path, *args, **kwargs)
        if parse_bucket_name(path.rpartition("/")[2]) is not None:
            listed.append(len(names))
        return names

    client.get_children = spy   # type: ignore[method-assign]
    try:
        yield listed
    finally:
        del client.get_children


def test_a_backlog_many_buckets_long_keeps_priority_and_fifo_order(
        zk_url: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """60 messages, 3 priorities, buckets of 5: one consumer gets them highest
    priority first and in publish order within a priority, from bounded listings."""
    queue = queue_of("long")
    priorities = [random.Random(7).choice([None, 3, 9]) for _ in range(60)]
    with Connection(url(zk_url)) as conn:
        publish(conn, queue, list(range(60)), priorities)
        most, where = largest_directory(zk_client)
        assert most <= 60 // SIZE + 3, f"{where} has {most} children"
        for bucket in buckets(zk_client, LAYOUT, "long"):
            assert zk_client.exists(bucket).numChildren <= SIZE
        # Reads names only: queue_declare's count is the buckets' child counts.
        assert conn.default_channel.queue_declare("long", passive=True).message_count == 60

        assignments = count_assignments(monkeypatch)
        with bucket_listings(conn) as listings:
            got = consume_all(conn, queue, 60)
    # A prefetch of 1: a claim per message at most (fewer once the consumer looks
    # ahead), and nobody to contend with.
    assert sum(given for given, _ in assignments) == 60
    assert len(assignments) <= 60 and not any(refused for _, refused in assignments)
    expected = sorted(range(60), key=lambda i: (-(priorities[i] or 0), i))
    assert [body for body, _ in got] == expected
    assert listings and max(listings) <= SIZE
    assert zk_client.get_children(LAYOUT.dead("long")) == []


def test_a_backlog_is_listed_once_bucket_by_bucket(zk_url: str) -> None:
    """A drain lists each bucket of its backlog once: deleting the buckets it
    emptied is no reason for the dispatcher to list the next ones again (it
    did, once per bucket: a drain of full buckets read every name twice).
    Making one still is: see test_a_trickle_leaves_no_trail_of_empty_buckets."""
    queue = queue_of("once")
    total, size = 240, 20
    with Connection(url(zk_url, size=size)) as conn:
        publish(conn, queue, list(range(total)))
        with bucket_listings(conn) as listed:
            got = consume_all(conn, queue, total)
    assert [body for body, _ in got] == list(range(total))
    # Every name once, and a bucket's worth more at most (the first listing may
    # come while the consumer's first look lists again).
    assert total <= sum(listed) <= total + size, listed


def test_a_trickle_leaves_no_trail_of_empty_buckets(zk_url: str, zk_client: KazooClient) -> None:
    """Published one at a time to a consumer that keeps up, messages never run
    the dispatcher's head out (it is complete, and the watches keep it so): it
    lists only when a new bucket is made, and that listing deletes the
    buckets it emptied."""
    queue = queue_of("trickle")
    total = 40
    got: list[int] = []
    with Connection(url(zk_url, "consumer")) as consumer_conn, \
            Connection(url(zk_url)) as conn:
        def on_message(body: Any, message: Any) -> None:
            got.append(body)
            message.ack()

        with Consumer(consumer_conn, [queue], callbacks=[on_message], prefetch_count=1):
            for value in range(total):
                publish(conn, queue, [value])
                deadline = time.monotonic() + 10
                while len(got) <= value and time.monotonic() < deadline:
                    try:
                        consumer_conn.drain_events(timeout=0.2)
                    except socket.timeout:
                        pass
            # The last roll's listing, and its deletes, a moment after the create.
            wait_until(lambda: len(buckets(zk_client, LAYOUT, "trickle")) <= 2, 10, 0.05,
                       lambda: f"emptied buckets left: {buckets(zk_client, LAYOUT, 'trickle')}")
    assert got == list(range(total))


def test_requeued_messages_go_back_to_their_place_across_buckets(
        zk_url: str, zk_client: KazooClient) -> None:
    """Requeued after their bucket was emptied and deleted, messages still come
    back ahead of everything published after them."""
    queue = queue_of("back")
    with Connection(url(zk_url)) as conn:
        publish(conn, queue, list(range(12)))   # buckets 0 (0-4), 1 (5-9), 2 (10-11)
        with Connection(url(zk_url, "taker")) as taker:
            simple = taker.SimpleQueue(queue)
            taken = [simple.get(timeout=5) for _ in range(7)]
            assert [m.payload for m in taken] == list(range(7))
            # The next listing finds bucket 0 empty with later ones behind it: deleted.
            conn.transport.queues.listing("back", 1)
            first = LAYOUT.bucket("back", bucket_name(inverted(None), 0))
            wait_until(lambda: zk_client.exists(first) is None, 5, 0.05,
                       "the empty bucket was not deleted")
            for message in reversed(taken):
                message.requeue()
            publish(conn, queue, [12, 13, 14])
        # The taker claimed more than it was given; closing put those back too.
        back = sum(parse_message_name(n).requeued for n in waiting(zk_client, LAYOUT, "back"))
        assert back >= 7
        got = consume_all(conn, queue, 15)
    assert [body for body, _ in got] == list(range(15))
    assert [parse_message_name(name).requeued for _, name in got] == (
        [True] * back + [False] * (15 - back))


def test_publishers_and_consumers_across_many_rolls_lose_nothing(
        zk_url: str, zk_client: KazooClient) -> None:
    """Two publishers (own sessions, own view of the newest bucket) and two
    consumers at once over ~100 rolls: every message once, none dead-lettered,
    no bucket's sequence past its size by more than one per publisher, emptied
    buckets removed."""
    queue = queue_of("roll")
    per_publisher = 250
    got: list[tuple[Any, str]] = []
    lock = threading.Lock()
    done = threading.Event()

    def publisher(name: str) -> None:
        with Connection(url(zk_url, name)) as conn:
            rng = random.Random(name)
            publish(conn, queue, [[name, i] for i in range(per_publisher)],
                    [rng.choice([None, 5]) for _ in range(per_publisher)])

    def consumer(name: str) -> None:
        with Connection(url(zk_url, name)) as conn:
            def on_message(body: Any, message: Any) -> None:
                with lock:
                    got.append((body, unowned_name(message.delivery_tag)))
                message.ack()

            with Consumer(conn, [queue], callbacks=[on_message], prefetch_count=4):
                while not done.is_set():
                    try:
                        conn.drain_events(timeout=0.2)
                    except socket.timeout:
                        pass

    with Connection(url(zk_url)) as setup:
        setup.default_channel.queue_declare("roll", durable=True)
    threads = [threading.Thread(target=consumer, args=(f"c{i}",)) for i in range(2)]
    threads += [threading.Thread(target=publisher, args=(f"p{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: len(got) >= 2 * per_publisher, 120, 0.1, "not everything arrived")
        time.sleep(0.5)   # anything delivered twice would show up now
    finally:
        done.set()
        for thread in threads:
            thread.join(30)
    bodies = sorted(tuple(body) for body, _ in got)
    assert bodies == sorted((f"p{p}", i) for p in range(2) for i in range(per_publisher))
    assert max(parse_message_name(name).seq for _, name in got) <= SIZE - 1 + 2
    used = {parse_message_name(name).bucket for _, name in got}
    # It really rolled: dozens of times. (Messages handed straight to an idle
    # consumer make no name in their bucket, so fewer than one roll per SIZE.)
    assert len(used) >= 2 * per_publisher // (SIZE + 2) // 3
    assert zk_client.get_children(LAYOUT.dead("roll")) == []
    with Connection(url(zk_url)) as conn:
        conn.transport.queues.listing("roll", 1)   # what a consumer's next look does
    wait_until(lambda: len(buckets(zk_client, LAYOUT, "roll")) <= 2, 5, 0.05,
               "emptied buckets were left behind")   # the newest of each priority stays
    for bucket in buckets(zk_client, LAYOUT, "roll"):
        assert creates(zk_client.exists(bucket)) <= SIZE + 2


def test_consumer_nodes_take_no_sequence_number(zk_url: str, zk_client: KazooClient) -> None:
    """consumers/ gets a create per consuming connection for as long as the
    system runs: its names must not come from a counter that ends."""
    with Connection(zk_url) as first, Connection(url(zk_url, "other")) as second:
        ids = [c.transport.session.ensure_registered()[0] for c in (first, second)]
        assert sorted(zk_client.get_children(LAYOUT.consumers)) == sorted(ids)
        # The oldest first, once the recovery watch has seen the second one.
        wait_until(lambda: first.transport.session.live_ids() == sorted(ids), 10,
                   message=f"{first.transport.session.live_ids()} != {sorted(ids)}")
