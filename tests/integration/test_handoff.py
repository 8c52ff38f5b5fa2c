"""Hand-off: idle consumers' offers, publishers taking them, and every way an offer ends."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_zk.broker.offer import Offer
from celery_zk.zk.layout import Layout
from celery_zk.zk.message_names import inline_body, parse_message_name
from celery_zk.zk.names import offer_name

from .queues import body_path, owned, stored_body, waiting
from .queues import unowned_creations as creations
from .sessions import apart
from .workers import read_log, wait_until

LAYOUT = Layout("/")   # as the zk_client fixture sees it: chrooted at the URL's path


def offers(zk_client: KazooClient, queue: str) -> list[str]:
    return zk_client.get_children(LAYOUT.offers(queue))


def unowned_creations(zk_client: KazooClient, queue: str) -> int:
    """How many messages unowned/ ever had created in it."""
    return creations(zk_client, LAYOUT, queue)


def publish(zk_url: str, queue: Queue, *bodies: Any, **kwargs: Any) -> None:
    with Connection(apart(zk_url, "publisher")) as other:   # another process
        producer = Producer(other.channel())
        for body in bodies:
            producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key,
                             **kwargs)


def expect_idle(conn: Connection) -> None:
    with pytest.raises(socket.timeout):
        conn.drain_events(timeout=0.3)


def lose_the_reply(monkeypatch: pytest.MonkeyPatch, client: KazooClient,
                   matches: Callable[[Any], bool],
                   meanwhile: Callable[[], None] = lambda: None) -> list[bool]:
    """The first multi of ``client`` whose operations ``matches`` commits, then
    (after ``meanwhile``) its reply is lost: ConnectionLoss. The list returned
    gets an entry when that happened."""
    from kazoo.exceptions import ConnectionLoss

    real_transaction, lost = client.transaction, []

    def losing() -> Any:
        txn = real_transaction()
        real_commit = txn.commit

        def commit() -> Any:
            results = real_commit()
            if not lost and matches(txn):
                lost.append(True)
                meanwhile()
                raise ConnectionLoss()   # committed; the reply lost
            return results
        txn.commit = commit
        return txn
    monkeypatch.setattr(client, "transaction", losing)
    return lost


@pytest.fixture
def zk_url(zk_url: str) -> str:
    """Hand-off on, for the consumers (offers) and the publishers (which take
    them) alike, whatever the default."""
    return f"{zk_url}?handoff=true"


@pytest.fixture
def conn(zk_url: str) -> Iterator[Connection]:
    with Connection(zk_url) as conn:
        yield conn


def consumer(conn: Connection, queue: Queue, got: list[Any], ack: bool = True,
             **kwargs: Any) -> Consumer:
    def on_message(body: Any, message: Any) -> None:
        got.append((body, message))
        if ack:
            message.ack()
    queue(conn.channel()).declare()
    return Consumer(conn, [queue], callbacks=[on_message], **kwargs)


def test_an_idle_consumer_is_handed_each_message_without_a_claim(
        conn: Connection, zk_url: str, zk_client: KazooClient) -> None:
    queue = Queue("hand", Exchange("hand", "direct"), "hand")
    got: list[Any] = []
    with consumer(conn, queue, got):
        for n in range(3):
            expect_idle(conn)
            wait_until(lambda: offers(zk_client, "hand"), 5, 0.02, "no offer was made")
            before = unowned_creations(zk_client, "hand")
            publish(zk_url, queue, n)
            conn.drain_events(timeout=5)
            # Straight into owned/: unowned/ never had the message.
            assert unowned_creations(zk_client, "hand") == before
            tag = got[-1][1].delivery_tag
            _, consumer_id, name = conn.transport.layout.split_owned_path(tag)
            assert consumer_id == conn.transport.session.consumer_id
            assert parse_message_name(name).seq == 0   # the handed name
            assert not got[-1][1].delivery_info.get("redelivered")
    assert [body for body, _ in got] == [0, 1, 2]
    wait_until(lambda: not offers(zk_client, "hand"), 5, 0.05, "offer left behind")
    wait_until(lambda: owned(zk_client, LAYOUT, "hand") == [], 5, 0.02,
               "not all acked")   # acks are held back a moment (Deferred)


def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path the consumers of this process read bodies from."""
    import celery_zk.broker.inbox as inbox_module

    paths: list[str] = []
    real = inbox_module.read_many

    def counting(client: KazooClient, batch: list[str]) -> list[Any]:
        paths.extend(batch)
        return real(client, batch)
    monkeypatch.setattr(inbox_module, "read_many", counting)
    return paths


def test_a_handed_message_brings_its_body_in_its_name(
        conn: Connection, zk_url: str, zk_client: KazooClient,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The inbox watch's event names the entry, and the name holds a copy of
    the body: delivered without a read. The start gate's time of the server's
    last answer is the offer's create, not nothing."""
    from celery_zk.compat.celery_pool import READ_AT

    reads = count_reads(monkeypatch)
    queue = Queue("inline", Exchange("inline", "direct"), "inline")
    got: list[Any] = []
    payload = {"args": [1, 2], "kwargs": {"x": "y" * 300}}
    with consumer(conn, queue, got):
        expect_idle(conn)
        wait_until(lambda: offers(zk_client, "inline"), 5, 0.02, "no offer was made")
        publish(zk_url, queue, payload, headers={"task": "proj.add"})
        conn.drain_events(timeout=5)
        delivered_at = time.monotonic()
    body, message = got[0]
    assert body == payload and message.headers == {"task": "proj.add"}
    name = message.delivery_tag.rpartition("/")[2]
    assert parse_message_name(name).seq == 0   # handed over
    assert inline_body(name) is not None, "the handed name carries no body"
    assert reads == [], f"read although its name carried the body: {reads}"
    assert 0 < delivered_at - message.properties[READ_AT] < 5
    # Acked as any message: the entry and the one body node go.
    wait_until(lambda: owned(zk_client, LAYOUT, "inline") == [], 5, 0.02, "not acked")
    assert zk_client.exists(body_path(LAYOUT, "inline", name)) is None


def test_the_longest_name_with_a_body_is_a_node_name(zk_client: KazooClient) -> None:
    """ZooKeeper takes (and lists, and deletes) an inbox entry whose name
    carries the longest body copy there may be."""
    from celery_zk.zk.message_names import INLINE_CHARS, handed_name

    name = handed_name(0, 1, "ab" * 8, body="A" * INLINE_CHARS)
    zk_client.ensure_path("/longest")
    zk_client.create(f"/longest/{name}")
    assert zk_client.get_children("/longest") == [name]
    zk_client.delete(f"/longest/{name}")


def test_a_body_too_big_for_a_name_is_handed_over_and_read(
        conn: Connection, zk_url: str, zk_client: KazooClient,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import base64
    import os

    reads = count_reads(monkeypatch)
    queue = Queue("thick", Exchange("thick", "direct"), "thick")
    got: list[Any] = []
    payload = base64.b64encode(os.urandom(6000)).decode()   # does not compress
    with consumer(conn, queue, got):
        expect_idle(conn)
        wait_until(lambda: offers(zk_client, "thick"), 5, 0.02, "no offer was made")
        publish(zk_url, queue, payload)
        conn.drain_events(timeout=5)
    body, message = got[0]
    name = message.delivery_tag.rpartition("/")[2]
    assert body == payload and parse_message_name(name).seq == 0
    assert inline_body(name) is None and "~" not in name
    assert len(reads) == 1


def test_no_offers_with_handoff_off(zk_url: str, zk_client: KazooClient) -> None:
    queue = Queue("nohand", Exchange("nohand", "direct"), "nohand")
    got: list[Any] = []
    with Connection(zk_url.replace("handoff=true", "handoff=false")) as conn, \
            consumer(conn, queue, got):
        expect_idle(conn)
        before = unowned_creations(zk_client, "nohand")
        publish(zk_url, queue, "x")
        conn.drain_events(timeout=5)
        assert offers(zk_client, "nohand") == []
        assert unowned_creations(zk_client, "nohand") == before + 1   # put (and then claimed)
    assert [body for body, _ in got] == ["x"]


def test_a_basic_get_makes_no_offer(conn: Connection, zk_client: KazooClient) -> None:
    """Only a consuming channel offers: nobody would deliver what a poller was handed."""
    queue = Queue("poll", Exchange("poll", "direct"), "poll")
    channel = conn.channel()
    queue(channel).declare()
    assert channel.basic_get("poll") is None
    assert offers(zk_client, "poll") == []


def test_a_full_prefetch_withdraws_the_offers_of_the_other_queues(
        conn: Connection, zk_url: str, zk_client: KazooClient) -> None:
    """A busy consumer must not be handed work an idle one could do."""
    first = Queue("pf-a", Exchange("pf-a", "direct"), "pf-a")
    second = Queue("pf-b", Exchange("pf-b", "direct"), "pf-b")
    got: list[Any] = []
    channel = conn.channel()
    for queue in (first, second):
        queue(channel).declare()
    with Consumer(channel, [first, second], prefetch_count=1,
                  callbacks=[lambda body, message: got.append((body, message))]):
        expect_idle(conn)
        wait_until(lambda: offers(zk_client, "pf-a") and offers(zk_client, "pf-b"), 5, 0.02)
        publish(zk_url, first, "a")
        conn.drain_events(timeout=5)   # delivered, not acked: the prefetch is full
        expect_idle(conn)
        assert offers(zk_client, "pf-b") == []
        publish(zk_url, second, "b")
        # Not handed over; the dispatcher gives it to pf-b's inbox (credit is per
        # queue, as RabbitMQ's prefetch is per consumer), where it waits for
        # the channel's prefetch to free.
        wait_until(lambda: owned(zk_client, LAYOUT, "pf-b"), 5, 0.02)
        assert unowned_creations(zk_client, "pf-b") == 1
        expect_idle(conn)
        got[0][1].ack()
        conn.drain_events(timeout=5)
    assert [body for body, _ in got] == ["a", "b"]


def test_a_message_handed_to_a_consumer_that_stops_goes_back_to_its_queue(
        conn: Connection, zk_url: str, zk_client: KazooClient) -> None:
    """The consumer stops between the hand-off and its delivery: the message
    goes back to unowned/, ahead of later arrivals, for the next consumer."""
    queue = Queue("stop", Exchange("stop", "direct"), "stop")
    got: list[Any] = []
    with consumer(conn, queue, got) as cons:
        expect_idle(conn)
        wait_until(lambda: offers(zk_client, "stop"), 5, 0.02, "no offer was made")
        publish(zk_url, queue, "orphan?")
        wait_until(lambda: owned(zk_client, LAYOUT, "stop"), 5, 0.02)
        cons.cancel()   # without a drain: never delivered
    assert got == []
    assert owned(zk_client, LAYOUT, "stop") == []
    assert offers(zk_client, "stop") == []
    back = waiting(zk_client, LAYOUT, "stop")
    assert len(back) == 1
    parsed = parse_message_name(back[0])
    assert parsed.requeued and parsed.order == 0   # ahead of later arrivals
    again: list[Any] = []
    with consumer(conn, queue, again):
        conn.drain_events(timeout=5)
    assert [body for body, _ in again] == ["orphan?"]
    assert again[0][1].delivery_info.get("redelivered")


def test_an_offer_stands_for_every_message_until_it_is_withdrawn(
        conn: Connection, zk_url: str, zk_client: KazooClient) -> None:
    """Publishers check an offer, they do not take it: one offer takes every
    message of a trickle (before 0.3.3 each hand-off deleted it, and the
    consumer made a new one: two more requests per message). Once withdrawn
    nothing more is handed over, even by a publisher whose view of the
    offers is behind."""
    queue = Queue("race", Exchange("race", "direct"), "race")
    queue(conn.channel()).declare()
    transport = conn.transport
    consumer_id, _ = transport.session.ensure_registered()
    transport.inbox("race").full()   # makes the inbox, as consuming would
    offer = Offer(transport.handoff, "race", transport.look_again)
    offer.make(consumer_id)
    wait_until(lambda: offers(zk_client, "race"), 5, 0.02, "no offer was made")
    made = offers(zk_client, "race")
    with Connection(apart(zk_url, "publisher")) as other:
        publisher, handoff = other.transport.publisher, other.transport.handoff
        assert handoff.give(publisher.new_message("race", b"first", 5))
        assert handoff.give(publisher.new_message("race", b"second", 5))
        assert waiting(zk_client, LAYOUT, "race") == []   # give() only hands over
        assert offers(zk_client, "race") == made and offer.outstanding
        offer.withdraw()
        assert offers(zk_client, "race") == []
        handoff._store("race", tuple(made))   # behind: the withdrawal not seen yet
        assert not handoff.give(publisher.new_message("race", b"third", 5))
    assert waiting(zk_client, LAYOUT, "race") == []   # a refused give stores nothing
    paths = owned(zk_client, LAYOUT, "race")
    assert {LAYOUT.split_owned_path(path)[1] for path in paths} == {consumer_id}
    assert sorted(stored_body(zk_client, LAYOUT, "race", path.rpartition("/")[2])[0]
                  for path in paths) == [b"first", b"second"]


def test_a_message_after_one_that_waited_is_not_handed_over_ahead_of_it(
        conn: Connection, zk_url: str, zk_client: KazooClient,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One publisher: the first message went to wait in line (its view of the
    offers was behind). While it waits the next ones wait in line too; once
    the dispatcher has given it, the next is handed over, and the consumer
    still delivers them in the order they were published (a handed name's
    sequence is zero: by name it went first)."""
    from celery_zk.broker.dispatcher import Dispatcher

    queue = Queue("order", Exchange("order", "direct"), "order")
    got: list[Any] = []
    real_give = Dispatcher._give
    with consumer(conn, queue, got):
        expect_idle(conn)
        wait_until(lambda: offers(zk_client, "order"), 5, 0.02, "no offer was made")
        with Connection(apart(zk_url, "publisher")) as other:
            producer = Producer(other.channel())
            handoff = other.transport.handoff
            handoff._known_offers("order")
            handoff._store("order", ())   # behind: no offer known yet
            monkeypatch.setattr(Dispatcher, "_give", lambda self, plan: None)   # it waits
            producer.publish(1, exchange=queue.exchange, routing_key="order")
            handoff._list(other.transport.handle.client, "order")   # caught up
            producer.publish(2, exchange=queue.exchange, routing_key="order")
            assert unowned_creations(zk_client, "order") == 2   # neither handed over
            monkeypatch.setattr(Dispatcher, "_give", real_give)
            for dispatcher in [d for d in gc_objects() if isinstance(d, Dispatcher)]:
                dispatcher.wake()
            wait_until(lambda: waiting(zk_client, LAYOUT, "order") == [], 10, 0.02,
                       "the dispatcher did not give them")
            wait_until(lambda: handoff._line_left("order"), 10, 0.02,
                       "the publisher did not see its message leave the line")
            producer.publish(3, exchange=queue.exchange, routing_key="order")
            assert unowned_creations(zk_client, "order") == 2   # handed over
        while len(got) < 3:
            conn.drain_events(timeout=5)
    assert [body for body, _ in got] == [1, 2, 3]


def gc_objects() -> list[Any]:
    import gc

    return gc.get_objects()


def test_a_publisher_sending_a_few_a_second_hands_over_after_one_waited(
        conn: Connection, zk_url: str, zk_client: KazooClient) -> None:
    """The order gap starts again with each message put in line, so it must be
    short: at 250 ms a publisher sending one message every few dozen ms (a
    latency probe, a trickle of user tasks) never handed anything over again
    once one message had waited."""
    queue = Queue("trickle", Exchange("trickle", "direct"), "trickle")
    got: list[Any] = []
    with consumer(conn, queue, got), Connection(apart(zk_url, "publisher")) as other:
        producer = Producer(other.channel())
        handoff = other.transport.handoff
        expect_idle(conn)
        wait_until(lambda: offers(zk_client, "trickle"), 5, 0.02, "no offer was made")
        handoff._known_offers("trickle")
        handoff._store("trickle", ())   # behind: the first waits in line
        for n in range(4):
            producer.publish(n, exchange=queue.exchange, routing_key="trickle")
            conn.drain_events(timeout=5)
            with pytest.raises(socket.timeout):   # idle again, briefly: it offers
                conn.drain_events(timeout=0.03)
            # The new offer, not the one withdrawn at the delivery: on a loaded
            # machine the publisher may not have heard of the withdrawal yet,
            # and a stale offer sends the message in line (by design).
            wait_until(lambda: (handoff._known_offers("trickle")
                                == tuple(offers(zk_client, "trickle")) != ()),
                       5, 0.005, "the publisher did not see the new offer")
    assert [body for body, _ in got] == [0, 1, 2, 3]
    assert unowned_creations(zk_client, "trickle") == 1   # the other three handed over


def test_a_publisher_faster_than_the_dispatcher_hands_over_again_once_its_waiting_one_went(
        conn: Connection, zk_url: str, zk_client: KazooClient) -> None:
    """A publisher whose message went to wait in line hands nothing over until
    that message has left ``unowned/`` (its watch says so), so its messages
    keep their order; then it hands over again. Before 0.3.3 a time gap (20
    ms) started again with each message put in line: a publisher sending
    more often than that (a steady load) never handed anything over again,
    and every message cost the dispatcher's multi and a read."""
    queue = Queue("fast", Exchange("fast", "direct"), "fast")
    got: list[Any] = []
    stop = threading.Event()
    with consumer(conn, queue, got), Connection(apart(zk_url, "publisher")) as other:
        expect_idle(conn)
        wait_until(lambda: offers(zk_client, "fast"), 5, 0.02, "no offer was made")

        def drain() -> None:
            while not stop.is_set():
                try:
                    conn.drain_events(timeout=0.1)
                except socket.timeout:
                    pass
        drainer = threading.Thread(target=drain)
        drainer.start()
        try:
            producer = Producer(other.channel())
            handoff = other.transport.handoff
            handoff._known_offers("fast")
            handoff._store("fast", ())   # behind: the first waits in line
            sent = 0
            deadline = time.monotonic() + 10
            while unowned_creations(zk_client, "fast") == sent and sent < 500:
                producer.publish(sent, exchange=queue.exchange, routing_key="fast")
                sent += 1
                # Every 10 ms: more often than 0.3's gap, and seldom enough for
                # the consumer to run dry and offer (a publisher always ahead
                # of it makes a backlog, where nobody offers).
                time.sleep(0.01)
                assert time.monotonic() < deadline, "never handed over again"
            in_line = unowned_creations(zk_client, "fast")
            assert in_line < sent, "every message waited in line"
            wait_until(lambda: len(got) == sent, 10, 0.02, "not all delivered")
        finally:
            stop.set()
            drainer.join()
    assert sorted(body for body, _ in got) == list(range(sent))


RunUntil = Callable[[Callable[[], object], str], None]


@contextmanager
def event_loop(conn: Connection, monkeypatch: pytest.MonkeyPatch) -> Iterator[RunUntil]:
    """``conn`` delivering from a kombu hub, as in a Celery worker, without the
    once-a-second look (nothing wakes it unasked); yields ``run_until(done,
    what)``, which turns the loop until ``done()`` (failing with ``what``)."""
    from kombu.asynchronous import Hub

    import celery_zk.broker.transport as transport_module

    monkeypatch.setattr(transport_module, "EVENT_LOOP_POKE", 3600.0)
    hub = Hub()
    loop = hub.create_loop()
    conn.transport.register_with_event_loop(conn.connection, hub)

    def run_until(done: Callable[[], object], what: str) -> None:
        deadline = time.monotonic() + 10
        while not done():
            assert time.monotonic() < deadline, what
            next(loop)
    try:
        yield run_until
    finally:
        conn.transport.unregister_from_event_loop(conn.connection, hub)
        hub.close()


def test_an_idle_worker_offers_once_its_running_tasks_end(
        zk_url: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a Celery worker a task is acked as it starts and counts as in hand
    until it ends, and nothing tells the transport that it ended: the event
    loop looks again by itself, instead of offering only at its next
    once-a-second look or message."""
    import celery.worker.state as worker_state

    class Running:   # a task request in Celery's worker state (kept weakly)
        pass

    queue = Queue("busy", Exchange("busy", "direct"), "busy")
    got: list[Any] = []
    with Connection(zk_url) as conn, consumer(conn, queue, got), \
            event_loop(conn, monkeypatch) as run_until:
        run_until(lambda: offers(zk_client, "busy"), "no offer while idle")
        running = Running()
        worker_state.reserved_requests.add(running)
        try:
            publish(zk_url, queue, "task")   # handed over; acked as it "starts"
            run_until(lambda: got, "not delivered")
            # Its one slot taken: the offer goes (after BUSY_GRACE), and stays gone.
            run_until(lambda: not offers(zk_client, "busy"), "the offer stayed")
            deadline = time.monotonic() + 0.2

            def no_offer_for_a_while() -> bool:   # the task runs
                assert not offers(zk_client, "busy")
                return time.monotonic() >= deadline
            run_until(no_offer_for_a_while, "")
        finally:
            worker_state.reserved_requests.discard(running)   # it ended
        run_until(lambda: offers(zk_client, "busy"), "no offer once the task ended")


def test_a_blocking_consumer_offers_again_as_it_acks_not_when_it_next_waits(
        conn: Connection, zk_url: str, zk_client: KazooClient) -> None:
    """A client that drains only while it waits for a reply (Celery's rpc://
    results, remote control's replies) withdraws its offer when a reply
    arrives. It offers again as it acks that reply, not once it waits for the
    next, by which time the next reply has often been sent already: it would
    wait for the dispatcher instead of being handed over."""
    queue = Queue("replies", Exchange("replies", "direct"), "replies")
    got: list[Any] = []
    with consumer(conn, queue, got):
        expect_idle(conn)   # waits: offers
        wait_until(lambda: offers(zk_client, "replies"), 5, 0.02, "no offer was made")
        for n in range(3):
            before = set(offers(zk_client, "replies"))
            sent = unowned_creations(zk_client, "replies")
            publish(zk_url, queue, n)
            conn.drain_events(timeout=5)   # acked in the callback; not waiting after it
            assert unowned_creations(zk_client, "replies") == sent   # it was handed over
            name = conn.transport.layout.split_owned_path(got[-1][1].delivery_tag)[2]
            assert parse_message_name(name).seq == 0
            # A new offer (the one the reply took was withdrawn as it arrived).
            wait_until(lambda before=before: set(offers(zk_client, "replies")) - before, 5, 0.02,
                       "no new offer after the ack until the client waits again")
    assert [body for body, _ in got] == [0, 1, 2]


def test_rpc_results_over_zk_are_handed_to_the_waiting_client(
        zk_url: str, zk_client: KazooClient, start_worker: Callable[..., Any]) -> None:
    """Celery's rpc:// result backend on a zk:// broker: each result is a
    message to the client's reply queue, which the client consumes only while
    get() waits. Between two calls its reply queue has an offer standing."""
    from celery import Celery

    start_worker(zk_url, backend="rpc://", concurrency=2)
    app = Celery("client", broker=zk_url, backend="rpc://")
    try:
        reply_queue = app.backend.oid
        for n in range(3):
            before = set(offers(zk_client, reply_queue)) if n else set()
            result = app.send_task("proj.app.add", args=(n, 1))
            assert result.get(timeout=30) == n + 1
            # Not waiting now: an offer for the next result stands anyway.
            wait_until(lambda before=before: set(offers(zk_client, reply_queue)) - before, 5,
                       0.02,
                       "no offer on the reply queue between two calls")
    finally:
        app.close()


def test_an_offer_withdrawn_for_the_dispatchers_work_is_made_again_once_dry(
        zk_url: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer whose offer is withdrawn because the dispatcher's work filled
    its pool (the queue has a backlog, as in a drain) offers again once it is
    dry with a slot free, and a publisher then hands it the next message.
    (A wait before that offer, doubled per withdrawal, gained no drain and no
    latency: docs/performance.md, removed in 0.4.)"""
    queue = Queue("backlog", Exchange("backlog", "direct"), "backlog")
    got: list[Any] = []
    with Connection(zk_url) as conn, consumer(conn, queue, got), \
            event_loop(conn, monkeypatch) as run_until:
        inbox = conn.transport.inbox("backlog")
        waiting_url = zk_url.replace("handoff=true", "handoff=false")   # takes no offer

        def offering() -> bool:
            # The offer it makes now, not the one it withdrew a moment ago: the
            # withdrawal's synced delete may land after the delivery's reads.
            offer = inbox.offer
            assert offer is not None
            return offer.token is not None and offers(zk_client, "backlog") == [
                offer_name(str(offer.consumer_id), offer.token)]
        for n in range(4):
            run_until(offering, "no offer")
            publish(waiting_url, queue, n)
            run_until(lambda n=n: len(got) == n + 1, "not delivered")
        run_until(offering, "no offer")
        publish(zk_url, queue, "handed")
        run_until(lambda: len(got) == 5, "not delivered")
        assert unowned_creations(zk_client, "backlog") == 4   # the fifth went straight


def test_work_that_leaves_a_pool_slot_free_keeps_the_offer(
        zk_url: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that runs two tasks at once keeps its offer while the dispatcher
    gives it one message at a time (a steady load on an empty queue), so a
    message published meanwhile is handed over; it withdraws the offer once
    both slots are busy, and offers again when one is free."""
    import celery.worker.state as worker_state

    import celery_zk.compat.celery_pool as celery_pool

    class Running:   # a task request in Celery's worker state (kept weakly)
        pass

    monkeypatch.setattr(celery_pool, "pool_slots", lambda: 2)
    queue = Queue("steady", Exchange("steady", "direct"), "steady")
    got: list[Any] = []
    with Connection(zk_url) as conn, consumer(conn, queue, got), \
            event_loop(conn, monkeypatch) as run_until:
        inbox = conn.transport.inbox("steady")
        offer = inbox.offer
        assert offer is not None
        waiting_url = zk_url.replace("handoff=true", "handoff=false")   # takes no offer
        run_until(lambda: offers(zk_client, "steady"), "no offer")
        made = offers(zk_client, "steady")
        for n in range(3):
            publish(waiting_url, queue, n)
            run_until(lambda n=n: len(got) == n + 1, "not delivered")
            assert offers(zk_client, "steady") == made   # the same offer, kept
        assert unowned_creations(zk_client, "steady") == 3
        publish(zk_url, queue, "handed")
        run_until(lambda: len(got) == 4, "not delivered")
        assert unowned_creations(zk_client, "steady") == 3   # straight into the inbox
        assert offers(zk_client, "steady") == made   # it stands

        # Two tasks run; what the worker learns of it comes with a delivery.
        running = [Running(), Running()]
        worker_state.reserved_requests.update(running)
        try:
            publish(waiting_url, queue, "third")
            run_until(lambda: len(got) == 5, "not delivered")
            run_until(lambda: not offers(zk_client, "steady") and not offer.outstanding,
                      "the offer stayed while every slot was busy")
            deadline = time.monotonic() + 0.2

            def no_offer_for_a_while() -> bool:
                assert not offers(zk_client, "steady")
                return time.monotonic() >= deadline
            run_until(no_offer_for_a_while, "")
            worker_state.reserved_requests.discard(running.pop())   # one ended
            run_until(lambda: offers(zk_client, "steady"), "no offer with a slot free again")
        finally:
            for request in running:
                worker_state.reserved_requests.discard(request)


def test_handed_work_that_takes_every_slot_keeps_the_offer_for_a_moment(
        zk_url: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of a trickle takes every pool slot for a moment: the offer
    stands, and what is published meanwhile is handed over too (withdrawing
    put it in line, through the dispatcher: the loaded latency's tail).
    Slots still taken after BUSY_GRACE withdraw it."""
    import celery.worker.state as worker_state

    import celery_zk.broker.offer as offer_module
    import celery_zk.compat.celery_pool as celery_pool

    class Running:   # a task request in Celery's worker state (kept weakly)
        pass

    monkeypatch.setattr(celery_pool, "pool_slots", lambda: 2)
    monkeypatch.setattr(offer_module, "BUSY_GRACE", 0.5)   # long enough to look at
    queue = Queue("burst", Exchange("burst", "direct"), "burst")
    got: list[Any] = []
    with Connection(zk_url) as conn, consumer(conn, queue, got), \
            event_loop(conn, monkeypatch) as run_until:
        offer = conn.transport.inbox("burst").offer
        assert offer is not None
        run_until(lambda: offers(zk_client, "burst"), "no offer")
        made = offers(zk_client, "burst")
        running = [Running(), Running()]
        worker_state.reserved_requests.update(running)   # both slots taken
        try:
            publish(zk_url, queue, "first")
            run_until(lambda: len(got) == 1, "not delivered")
            assert offers(zk_client, "burst") == made and offer.outstanding
            publish(zk_url, queue, "second")   # still handed over
            run_until(lambda: len(got) == 2, "not delivered")
            assert unowned_creations(zk_client, "burst") == 0
            run_until(lambda: not offers(zk_client, "burst") and not offer.outstanding,
                      "the offer stayed while every slot stayed taken")
            worker_state.reserved_requests.difference_update(running)   # they ended
            run_until(lambda: offers(zk_client, "burst"), "no offer with the slots free")
        finally:
            worker_state.reserved_requests.difference_update(running)
    assert [body for body, _ in got] == ["first", "second"]


@pytest.mark.parametrize("pool, concurrency", [("threads", 1), ("threads", 2), ("prefork", 2)])
def test_a_real_worker_offers_while_a_pool_slot_is_free(
        pool: str, concurrency: int, zk_url: str, zk_client: KazooClient,
        start_worker: Callable[..., Any], task_log: Path) -> None:
    """A ``celery worker`` running a task still offers while its pool has a
    free slot (a message published then starts at once), and not while every
    slot is busy (the message would wait behind the task)."""
    from celery import Celery

    runs = 4.0
    start_worker(zk_url, log=task_log, pool=pool, concurrency=concurrency)
    wait_until(lambda: offers(zk_client, "celery"), 30, 0.05, "an idle worker made no offer")
    app = Celery("client", broker=zk_url, set_as_current=False)
    try:
        app.send_task("proj.app.record_then_sleep", args=("long", runs))
        wait_until(lambda: read_log(task_log), 10, 0.02, "the task did not start")
        started = time.monotonic()
        if concurrency > 1:
            wait_until(lambda: offers(zk_client, "celery"), runs, 0.02,
                       "no offer while a slot was free")
            assert time.monotonic() - started < runs   # made while the task ran
        else:
            # A withdrawal sent as the message came may land after the start.
            wait_until(lambda: not offers(zk_client, "celery"), 2, 0.02,
                       "the offer stayed while the only slot was busy")
            while time.monotonic() - started < runs / 2:
                assert not offers(zk_client, "celery"), "an offer while the only slot was busy"
                time.sleep(0.05)
    finally:
        app.close()


@pytest.mark.parametrize("handoff", ["true", "false"])
def test_a_requeued_handed_message_goes_ahead_of_later_arrivals(
        zk_url: str, zk_client: KazooClient, handoff: str) -> None:
    queue = Queue("rq", Exchange("rq", "direct"), "rq")
    got: list[Any] = []
    with Connection(zk_url.replace("handoff=true", f"handoff={handoff}")) as conn, \
            consumer(conn, queue, got, ack=False, prefetch_count=1):
        expect_idle(conn)
        if handoff == "true":
            wait_until(lambda: offers(zk_client, "rq"), 5, 0.02, "no offer was made")
        publish(zk_url, queue, "first")
        conn.drain_events(timeout=5)
        if handoff == "true":
            assert unowned_creations(zk_client, "rq") == 0   # handed over
        publish(zk_url, queue, "second", "third")   # the prefetch is full: no offer
        got[0][1].requeue()
        for _ in range(3):
            conn.drain_events(timeout=5)
            got[-1][1].ack()
    assert [body for body, _ in got] == ["first", "first", "second", "third"]


def test_a_handed_message_of_a_killed_consumer_is_requeued(
        zk_url: str, zk_client: KazooClient) -> None:
    """The owner's session ends before it delivers what it was handed: the
    recovery leader requeues it like any owned message."""
    queue = Queue("dies", Exchange("dies", "direct"), "dies")
    doomed = Connection(apart(zk_url, "doomed"))   # a worker process to be killed
    got: list[Any] = []
    cons = consumer(doomed, queue, got)
    cons.consume()
    expect_idle(doomed)
    wait_until(lambda: offers(zk_client, "dies"), 5, 0.02, "no offer was made")
    publish(zk_url, queue, "survives")   # handed over; doomed never drains again
    wait_until(lambda: owned(zk_client, LAYOUT, "dies"), 5, 0.02)
    # End its session without the transport's close: no withdrawal, no requeue
    # by the owner, as when a worker is killed.
    doomed.transport.handle.client.stop()
    try:
        with Connection(zk_url) as survivor:   # a live consumer does the recovery
            again: list[Any] = []
            with consumer(survivor, queue, again):
                wait_until(lambda: _drain_one(survivor) or again, 20, 0.0,
                           "the handed message was not requeued")
            assert [body for body, _ in again] == ["survives"]
            assert again[0][1].delivery_info.get("redelivered")
    finally:
        try:
            doomed.release()
        except Exception:   # its session is gone: closing may complain
            pass
    assert got == []


def _drain_one(conn: Connection) -> bool:
    try:
        conn.drain_events(timeout=0.5)
    except socket.timeout:
        return False
    return True


def test_offers_of_every_consumer_are_used_by_concurrent_publishers(
        zk_url: str, zk_client: KazooClient) -> None:
    """Several publishers, several idle consumers: every message is delivered
    exactly once, however the offers were raced for."""
    queue = Queue("many", Exchange("many", "direct"), "many")
    conns = [Connection(zk_url) for _ in range(3)]
    got: list[Any] = []
    lock = threading.Lock()
    consumers = []
    try:
        for c in conns:
            queue(c.channel()).declare()
            cons = Consumer(c, [queue], callbacks=[
                lambda body, message: (lock.acquire(), got.append(body), lock.release(),
                                       message.ack())])
            cons.consume()
            consumers.append(cons)
            expect_idle(c)
        wait_until(lambda: len(offers(zk_client, "many")) == 3, 5, 0.02)

        def publisher(start: int) -> None:
            publish(zk_url, queue, *range(start, start + 20))

        threads = [threading.Thread(target=publisher, args=(i * 20,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for _ in range(200):
            if len(got) >= 80:
                break
            for c in conns:
                _drain_one_quick(c)
    finally:
        for cons in consumers:
            cons.cancel()
        for c in conns:
            c.close()
    assert sorted(got) == list(range(80))
    assert owned(zk_client, LAYOUT, "many") == []
    assert waiting(zk_client, LAYOUT, "many") == []


def _drain_one_quick(conn: Connection) -> None:
    try:
        conn.drain_events(timeout=0.05)
    except socket.timeout:
        pass


def test_handed_payload_is_the_published_message(
        conn: Connection, zk_url: str, zk_client: KazooClient) -> None:
    queue = Queue("payload", Exchange("payload", "direct"), "payload")
    got: list[Any] = []
    with consumer(conn, queue, got):
        expect_idle(conn)
        wait_until(lambda: offers(zk_client, "payload"), 5, 0.02)
        publish(zk_url, queue, {"k": [1, 2]}, priority=7, headers={"h": "v"})
        conn.drain_events(timeout=5)
    body, message = got[0]
    assert body == {"k": [1, 2]} and message.headers == {"h": "v"}
    assert message.properties.get("priority") == 7
    name = message.delivery_tag.rpartition("/")[2]
    assert parse_message_name(name).priority == 7
    assert json.loads(message.body) == body


def test_an_offer_withdrawn_before_it_was_sent_is_never_made(
        conn: Connection, zk_client: KazooClient) -> None:
    """Offers are sent after a short delay; a withdrawal within it must win,
    or an offer nobody tracks would collect a message nobody delivers."""
    queue = Queue("early-out", Exchange("early-out", "direct"), "early-out")
    queue(conn.channel()).declare()
    transport = conn.transport
    consumer_id, _ = transport.session.ensure_registered()
    for _ in range(5):
        offer = Offer(transport.handoff, "early-out", transport.look_again)
        offer.make(consumer_id)
        offer.withdraw()
    time.sleep(0.2)   # well past the delay: anything still due has been sent
    assert offers(zk_client, "early-out") == []


def test_an_ack_held_back_is_sent_before_the_connection_closes(
        zk_url: str, zk_client: KazooClient) -> None:
    queue = Queue("late-ack", Exchange("late-ack", "direct"), "late-ack")
    with Connection(zk_url) as conn:
        bound = queue(conn.channel())
        bound.declare()
        publish(zk_url, queue, "x")
        message = bound.get()
        assert message is not None and message.payload == "x"
        message.ack()
    # Neither still owned nor requeued by the close: the ack landed first.
    assert owned(zk_client, LAYOUT, "late-ack") == []
    assert waiting(zk_client, LAYOUT, "late-ack") == []


@contextmanager
def handing_over(conn: Connection, zk_url: str, zk_client: KazooClient,
                 name: str) -> Iterator[tuple[Queue, list[Any], Connection]]:
    """Queue ``name`` with a consumer on ``conn`` (acking) that has made its
    offer; the messages it got, and another process's connection to publish from."""
    queue = Queue(name, Exchange(name, "direct"), name)
    got: list[Any] = []
    with consumer(conn, queue, got):
        expect_idle(conn)
        wait_until(lambda: offers(zk_client, name), 5, 0.02, "no offer was made")
        with Connection(apart(zk_url, "publisher")) as other:
            yield queue, got, other


def test_a_hand_off_whose_reply_was_lost_syncs_before_it_looks(
        conn: Connection, zk_url: str, zk_client: KazooClient,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The multi committed and its reply was lost. Whether it committed is read
    after a sync: a server behind the leader (reconnected to after a cut) could
    answer no, and the message would be published a second time (the nemesis
    saw one apply_async stored twice)."""
    with handing_over(conn, zk_url, zk_client, "lost") as (queue, got, other):
        client = other.transport.handle.client
        synced_paths: list[str] = []
        monkeypatch.setattr(client, "sync", lambda path: synced_paths.append(path) or path)
        lose_the_reply(monkeypatch, client, lambda txn: any(
            "/offers/" in str(op.path) for op in txn.operations))
        Producer(other.channel()).publish("once", exchange=queue.exchange, routing_key="lost")
        assert synced_paths and "/bodies/" in synced_paths[0]
        conn.drain_events(timeout=5)
    assert [body for body, _ in got] == ["once"]
    assert waiting(zk_client, LAYOUT, "lost") == []
    # Acks are coalesced: the delete commits a few milliseconds after ack().
    wait_until(lambda: owned(zk_client, LAYOUT, "lost") == [], 5, 0.02, "the ack never landed")


def fail_the_first_sync(monkeypatch: pytest.MonkeyPatch, client: KazooClient) -> list[str]:
    """The first ``sync`` of ``client`` fails as kazoo's retry does when the
    connection stays down past its deadline; the paths synced after it."""
    from kazoo.retry import RetryFailedError

    real_sync, synced_paths = client.sync, []

    def sync(path: str) -> Any:
        synced_paths.append(path)
        if len(synced_paths) == 1:
            raise RetryFailedError("the connection stayed down")
        return real_sync(path)
    monkeypatch.setattr(client, "sync", sync)
    return synced_paths


def test_a_hand_off_whose_reply_was_lost_looks_again_if_its_look_failed(
        conn: Connection, zk_url: str, zk_client: KazooClient,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The multi committed, its reply was lost, and the look that would tell
    failed too (the connection was still down). The retry looks before it
    stores anything: without that it handed the message again, found its body
    there, and published it a second time."""
    with handing_over(conn, zk_url, zk_client, "relook") as (queue, got, other):
        client = other.transport.handle.client
        synced_paths = fail_the_first_sync(monkeypatch, client)
        lost = lose_the_reply(monkeypatch, client, lambda txn: any(
            "/offers/" in str(op.path) for op in txn.operations))
        Producer(other.channel()).publish("once", exchange=queue.exchange,
                                          routing_key="relook")
        assert lost and len(synced_paths) == 2   # the failed look, then the retry's
        conn.drain_events(timeout=5)
        expect_idle(conn)   # no second copy
        assert waiting(zk_client, LAYOUT, "relook") == []
    assert [body for body, _ in got] == ["once"]


def test_a_hand_off_stored_again_after_a_lost_reply_says_so(
        conn: Connection, zk_url: str, zk_client: KazooClient,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Stored, delivered and acked before the publisher could look (its look
    failing first, the connection still down): nothing is left to find, so it
    is handed again, and it runs twice (at-least-once). That second copy is
    always said, before it is made: the nemesis counts a duplicate as a
    publish retry by that warning (it saw one unsaid)."""
    def delivered_and_acked() -> None:
        conn.drain_events(timeout=5)
        wait_until(lambda: owned(zk_client, LAYOUT, "again") == [], 5, 0.02,
                   "the ack never landed")

    with handing_over(conn, zk_url, zk_client, "again") as (queue, got, other):
        client = other.transport.handle.client
        fail_the_first_sync(monkeypatch, client)
        lose_the_reply(monkeypatch, client, lambda txn: any(
            "/offers/" in str(op.path) for op in txn.operations),
            meanwhile=delivered_and_acked)
        with caplog.at_level("WARNING", logger="celery_zk.broker.handoff"):
            Producer(other.channel()).publish("once", exchange=queue.exchange,
                                              routing_key="again")
        conn.drain_events(timeout=5)
    assert [body for body, _ in got] == ["once", "once"]
    said = [r.getMessage() for r in caplog.records if "reply to a hand-off was lost" in
            r.getMessage()]
    assert len(said) == 1, said


def test_a_publish_whose_reply_was_lost_finds_its_message_in_an_inbox(
        zk_url: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The publish's multi committed and its reply was lost; before the publisher
    looked, the dispatcher had moved the message into a consumer's inbox. It is
    found there, not stored a second time (the nemesis saw one apply_async run
    twice: the lookup searched only the bucket it was published to)."""
    url = zk_url.replace("handoff=true", "handoff=false")   # through the dispatcher
    queue = Queue("moved", Exchange("moved", "direct"), "moved")
    got: list[Any] = []
    with Connection(url) as conn, consumer(conn, queue, got, ack=False):
        expect_idle(conn)
        with Connection(apart(url, "publisher")) as other:
            lost = lose_the_reply(
                monkeypatch, other.transport.handle.client,
                lambda txn: any("/unowned/" in str(op.path) for op in txn.operations),
                meanwhile=lambda: wait_until(lambda: owned(zk_client, LAYOUT, "moved"), 5,
                                             0.01, "the dispatcher never gave the message"))
            Producer(other.channel()).publish("once", exchange=queue.exchange,
                                              routing_key="moved")
            assert lost
        conn.drain_events(timeout=5)
        expect_idle(conn)   # no second copy
        assert len(owned(zk_client, LAYOUT, "moved")) == 1
        assert waiting(zk_client, LAYOUT, "moved") == []
    assert [body for body, _ in got] == ["once"]
