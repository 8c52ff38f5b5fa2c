"""One dispatcher per queue, consumers with inboxes (issue 26), on a real server.

Several kombu connections with sessions of their own play several consumer
processes; real ``celery worker`` processes are in test_faults.py and
test_transport_workers.py.
"""
from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_zk.broker.acks import Acks
from celery_zk.broker.credit import HOLD, IDLE
from celery_zk.broker.dispatcher import Dispatcher
from celery_zk.ops.upgrade import upgrade
from celery_zk.zk.config import ZKOptions
from celery_zk.zk.layout import Layout
from celery_zk.zk.message_names import parse_message_name

from .queues import owned, owners, waiting
from .sessions import apart
from .spies import count_assignments
from .workers import wait_until


def layout_of(zk_url: str) -> Layout:
    """Paths as the ``zk_client`` fixture sees them: it is chrooted at the URL's path."""
    return Layout("/")


def queue_of(name: str) -> Queue:
    return Queue(name, Exchange(name, "direct"), name)


def publish(conn: Connection, queue: Queue, values: list[Any],
            priorities: list[int | None] | None = None) -> None:
    producer = Producer(conn.channel())
    for i, value in enumerate(values):
        priority = priorities[i] if priorities else None
        extra = {} if priority is None else {"priority": priority}
        producer.publish({"v": value}, exchange=queue.exchange, routing_key=queue.name,
                         declare=[queue], **extra)


def drain_until(conn: Connection, got: list[Any], count: int, timeout: float,
                poll: float = 1.0) -> None:
    """Drain ``conn`` until ``got`` holds ``count`` messages or ``timeout`` passed
    (the caller asserts what arrived)."""
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        try:
            conn.drain_events(timeout=poll)
        except OSError:   # socket.timeout: nothing this round
            pass


class Drainer(threading.Thread):
    """One consumer connection with a session of its own, acking what it gets."""

    def __init__(self, url: str, queue: Queue, name: str, prefetch: int = 2,
                 hold: float = 0.0) -> None:
        super().__init__(daemon=True, name=f"drainer-{name}")
        self.conn = Connection(apart(url, name))
        self.queue, self.prefetch, self.hold = queue, prefetch, hold
        self.got: list[Any] = []
        self.stop = threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:
        def on_message(body: Any, message: Any) -> None:
            self.got.append(body["v"])
            if self.hold:
                time.sleep(self.hold)
            message.ack()

        with self.conn, Consumer(self.conn, [self.queue], callbacks=[on_message],
                                 prefetch_count=self.prefetch):
            self.ready.set()
            while not self.stop.is_set():
                try:
                    self.conn.drain_events(timeout=0.2)
                except TimeoutError:
                    pass
                except OSError:   # socket.timeout
                    pass


@pytest.fixture
def drainers(zk_url: str) -> Iterator[list[Drainer]]:
    started: list[Drainer] = []
    yield started
    for drainer in started:
        drainer.stop.set()
    for drainer in started:
        drainer.join(10)


def leaders(queue: str) -> list[Dispatcher]:
    import gc

    return [d for d in gc.get_objects() if isinstance(d, Dispatcher)
            and d.queue == queue and d.leading and (thread := d._thread) is not None
            and thread.is_alive()]


def test_one_dispatcher_feeds_every_consumer_without_a_conflict(
        zk_url: str, zk_client: KazooClient, drainers: list[Drainer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Four consumers with sessions of their own: one of them dispatches; each
    message runs once; no assignment is ever refused; work is spread."""
    queue = queue_of("spread")
    for i in range(4):
        drainer = Drainer(zk_url, queue, f"c{i}", prefetch=2, hold=0.01)
        drainers.append(drainer)
        drainer.start()
        assert drainer.ready.wait(10)
    wait_until(lambda: len(leaders("spread")) == 1, 10, message="no single dispatcher")
    assignments = count_assignments(monkeypatch)
    with Connection(zk_url) as conn:
        publish(conn, queue, list(range(200)))
    wait_until(lambda: sum(len(d.got) for d in drainers) >= 200, 60,
               message="not every message was delivered")
    time.sleep(0.3)
    counts = Counter(v for d in drainers for v in d.got)
    assert sorted(counts) == list(range(200)) and set(counts.values()) == {1}
    assert assignments and not any(refused for _, refused in assignments)
    assert all(d.got for d in drainers), [len(d.got) for d in drainers]
    # Every consumer's credit is in its node, under the queue's consumers/.
    layout = layout_of(zk_url)
    nodes = zk_client.get_children(layout.queue_consumers("spread"))
    assert len(nodes) == 4
    credits = [json.loads(zk_client.get(layout.queue_consumer("spread", n))[0])["credit"]
               for n in nodes]
    # Each its prefetch, or ZKOptions.lookahead times it once it ran dry while fast (hold 10 ms).
    assert set(credits) <= {2, 2 * ZKOptions.lookahead}, credits


def test_an_inbox_never_holds_more_than_its_credit(
        zk_url: str, zk_client: KazooClient, drainers: list[Drainer]) -> None:
    queue = queue_of("credit")
    with Connection(zk_url) as conn:
        publish(conn, queue, list(range(30)))
    drainer = Drainer(zk_url, queue, "slow", prefetch=3, hold=0.1)
    drainers.append(drainer)
    drainer.start()
    layout = layout_of(zk_url)
    most = 0
    deadline = time.monotonic() + 30
    while len(drainer.got) < 30 and time.monotonic() < deadline:
        most = max(most, len(owned(zk_client, layout, "credit")))
        time.sleep(0.01)
    assert len(drainer.got) == 30
    assert 1 <= most <= 3 + 1   # its credit, and one handed over at most


def test_a_consumer_is_given_work_once_it_consumes_before_its_first_look(
        zk_url: str, zk_client: KazooClient) -> None:
    """A Celery worker calls basic_consume right before worker_ready and looks
    at its queues only after it: the consumer joins at basic_consume, so its
    inbox fills meanwhile (as RabbitMQ sends a consumer its prefetch). It
    joined on its first look until 2026-11-28."""
    queue = queue_of("joins-early")
    with Connection(zk_url) as conn:
        publish(conn, queue, list(range(10)))
    layout = layout_of(zk_url)
    got: list[Any] = []
    with Connection(apart(zk_url, "early")) as conn:
        channel = conn.channel()
        channel.basic_qos(0, 3, False)
        consumer = Consumer(channel, [queue], callbacks=[lambda body, m: got.append(body)],
                            auto_declare=True)
        consumer.consume()   # and nothing drained: no look yet
        assert credit_of(zk_client, "joins-early") == [3]
        wait_until(lambda: len(owned(zk_client, layout, "joins-early")) == 3, 10,
                   message="the dispatcher gave nothing to a consumer before its first look")
        assert not got
        drain_until(conn, got, 3, 10, poll=0.2)
        assert [body["v"] for body in got] == [0, 1, 2]


def credit_of(zk_client: KazooClient, queue: str) -> list[int]:
    layout = layout_of("")
    nodes = sorted(zk_client.get_children(layout.queue_consumers(queue)),
                   key=lambda n: n.rpartition("-")[2])   # first registered first
    return [json.loads(zk_client.get(layout.queue_consumer(queue, n))[0])["credit"]
            for n in nodes]


def test_a_fast_consumer_looks_ahead_and_a_slow_one_does_not(
        zk_url: str, zk_client: KazooClient, drainers: list[Drainer]) -> None:
    """A consumer that delivers its prefetch within FAST s and runs dry publishes
    ZKOptions.lookahead times its prefetch as its credit, and its prefetch again once idle
    for IDLE s; one whose messages take longer never does."""
    fast, slow = queue_of("ahead"), queue_of("behind")
    with Connection(zk_url) as conn:
        publish(conn, fast, list(range(300)))
        publish(conn, slow, list(range(12)))
    drainers.append(Drainer(zk_url, fast, "fast", prefetch=2))
    drainers.append(Drainer(zk_url, slow, "slow", prefetch=2, hold=0.15))
    for drainer in drainers:
        drainer.start()
    wait_until(lambda: credit_of(zk_client, "ahead") == [2 * ZKOptions.lookahead], 20,
               message="the fast consumer never looked ahead")
    wait_until(lambda: len(drainers[0].got) == 300 and len(drainers[1].got) == 12, 30,
               message="not everything was delivered")
    assert sorted(drainers[0].got) == list(range(300))
    assert credit_of(zk_client, "behind") == [2]
    time.sleep(IDLE + 0.5)   # idle: a look (drain_events) ends the lookahead
    wait_until(lambda: credit_of(zk_client, "ahead") == [2], 10,
               message="the lookahead outlived the idle time")


def test_lookahead_1_keeps_an_inbox_to_its_prefetch(
        zk_url: str, zk_client: KazooClient, drainers: list[Drainer]) -> None:
    queue = queue_of("strict")
    with Connection(zk_url) as conn:
        publish(conn, queue, list(range(200)))
    drainer = Drainer(f"{zk_url}?lookahead=1", queue, "strict", prefetch=2)
    drainers.append(drainer)
    drainer.start()
    most = 0
    deadline = time.monotonic() + 30
    while len(drainer.got) < 200 and time.monotonic() < deadline:
        most = max(most, len(owned(zk_client, layout_of(""), "strict")))
    assert sorted(drainer.got) == list(range(200))
    assert most <= 2 and credit_of(zk_client, "strict") == [2]


@contextlib.contextmanager
def looking_ahead(zk_url: str, zk_client: KazooClient, name: str
                  ) -> Iterator[tuple[Connection, Connection, list[int], list[Any]]]:
    """A consumer (prefetch 2) that drained 60 messages fast and so looks ahead:
    ``(publisher, its connection, what it got, messages it holds unacked)``.
    It holds (does not ack) every message of value 100 or more: a long task."""
    queue = queue_of(name)
    got: list[int] = []
    held: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body["v"])
        if body["v"] >= 100:
            held.append(message)   # a long task: not acked, the prefetch fills
        else:
            message.ack()

    with Connection(zk_url) as publisher, Connection(apart(zk_url, name)) as conn:
        with Consumer(conn, [queue], callbacks=[on_message], prefetch_count=2):
            publish(publisher, queue, list(range(60)))
            drain_until(conn, got, 60, 20, poll=0.1)
            assert credit_of(zk_client, name) == [2 * ZKOptions.lookahead]
            yield publisher, conn, got, held


def test_what_waits_behind_a_long_task_goes_back_for_other_consumers(
        zk_url: str, zk_client: KazooClient, drainers: list[Drainer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer looking ahead holds more than its channel may take; when its
    prefetch is full (long tasks) for HOLD s, the messages waiting in its inbox
    go back to the queue, in multis, and another consumer gets them."""
    batches: list[int] = []
    one_by_one: list[str] = []
    requeue_many, requeue = Acks.requeue_many, Acks.requeue

    def counted_many(self: Acks, owned_paths: list[str], *args: Any) -> int:
        batches.append(len(owned_paths))
        return requeue_many(self, owned_paths, *args)

    def counted(self: Acks, owned_path: str, *args: Any, **kwargs: Any) -> bool:
        one_by_one.append(owned_path)
        return requeue(self, owned_path, *args, **kwargs)

    monkeypatch.setattr(Acks, "requeue_many", counted_many)
    monkeypatch.setattr(Acks, "requeue", counted)
    queue = queue_of("long")
    with looking_ahead(zk_url, zk_client, "long") as (publisher, busy, got, held):
        publish(publisher, queue, [100, 101] + list(range(200, 210)))
        drain_until(busy, got, 62, 10, poll=0.1)
        assert got[60:] == [100, 101]
        # More given than the prefetch: waiting behind them (nothing gives them
        # back while this thread does not look: it calls no drain_events here).
        wait_until(lambda: len(owned(zk_client, layout_of(""), "long")) > 2, 10,
                   message="nothing was given beyond the prefetch")
        other = Drainer(zk_url, queue, "other", prefetch=2)
        drainers.append(other)
        other.start()
        # The busy consumer keeps looking (a worker's event loop does, each second).
        deadline = time.monotonic() + HOLD + 10
        while len(other.got) < 10 and time.monotonic() < deadline:
            drain_until(busy, got, 63, 0.2, poll=0.1)
        assert sorted(other.got) == list(range(200, 210))
        assert got[62:] == []   # the busy consumer delivered none of them
        # Given back in multis, not one synced write each.
        assert one_by_one == [] and sum(batches) >= 10 and max(batches) > 1, (batches, one_by_one)
        assert credit_of(zk_client, "long")[0] == 2   # its lookahead ended
        for message in held:
            message.ack()


def test_a_prefetch_full_between_deliveries_gives_nothing_back(
        zk_url: str, zk_client: KazooClient) -> None:
    """Quick tasks keep a looking-ahead consumer's prefetch full between its
    deliveries (a prefork worker draining a backlog). What waits in its inbox
    is delivered in order, however long that goes on: it would be delivered
    within HOLD s at that pace."""
    queue = queue_of("steady")
    with looking_ahead(zk_url, zk_client, "steady") as (publisher, conn, got, held):
        values = list(range(1000, 1150))   # held until acked below: the prefetch fills
        publish(publisher, queue, values)
        redelivered: list[int] = []
        began = time.monotonic()
        while len(got) < 60 + len(values) and time.monotonic() < began + HOLD * 4 + 10:
            drain_until(conn, got, len(got) + 2 - len(held), 1, poll=0.1)
            with contextlib.suppress(OSError):   # the prefetch is full: a look, no delivery
                conn.drain_events(timeout=0.005)
            time.sleep(0.02)   # quick tasks: at this pace the inbox empties within HOLD
            for message in held:
                if message.delivery_info.get("redelivered"):
                    redelivered.append(message.payload["v"])
                message.ack()
            held.clear()
        assert time.monotonic() - began > HOLD * 1.5, \
            "drained before HOLD passed: the test proves nothing"
        assert redelivered == []
        assert got[60:] == values


def test_what_waits_behind_a_trickle_goes_back_for_other_consumers(
        zk_url: str, zk_client: KazooClient, drainers: list[Drainer]) -> None:
    """A long task holds one of a looking-ahead consumer's two prefetch slots and
    slow ones pass through the other: at that pace what waits in its inbox
    would take far more than HOLD s, so it goes back, and another consumer
    gets it."""
    queue = queue_of("trickle")
    with looking_ahead(zk_url, zk_client, "trickle") as (publisher, busy, got, held):
        values = list(range(200, 240))
        publish(publisher, queue, [100] + values)
        drain_until(busy, got, 62, 10, poll=0.1)
        assert got[60] == 100
        wait_until(lambda: len(owned(zk_client, layout_of(""), "trickle")) > 2, 10,
                   message="nothing was given beyond the prefetch")
        other = Drainer(zk_url, queue, "other", prefetch=2)
        drainers.append(other)
        other.start()
        deadline = time.monotonic() + HOLD * 3 + 10
        while len(got) - 61 + len(other.got) < len(values) and time.monotonic() < deadline:
            with contextlib.suppress(OSError):   # full: it looks, as a worker's loop does
                busy.drain_events(timeout=0.4)   # meanwhile a slow task runs
            for message in held[1:]:
                message.ack()
            del held[1:]
            drain_until(busy, got, len(got) + 1, 0.2, poll=0.1)
        assert other.got, "nothing went back: the trickle held everything"
        assert sorted(got[61:] + other.got) == values   # each delivered once
        assert credit_of(zk_client, "trickle")[0] == 2   # its lookahead ended
        for message in held:
            message.ack()


def recovery_leader(conn: Connection) -> Consumer:
    """Make ``conn``'s process a consumer (of a queue of its own), and so the
    recovery leader when it is the oldest one."""
    consumer = Consumer(conn, [queue_of("lead")])
    consumer.consume()
    return consumer


def test_a_dead_consumers_inbox_goes_back_each_message_to_its_place(
        zk_url: str, zk_client: KazooClient) -> None:
    """A consumer whose session ends holds messages in its inbox: the recovery
    leader puts each back where it was, ahead of everything published later."""
    queue = queue_of("dies")
    layout = layout_of(zk_url)
    with Connection(zk_url) as survivor:
        recovery_leader(survivor)
        publish(survivor, queue, list(range(6)))
        doomed = Connection(apart(zk_url, "doomed"))
        got: list[Any] = []
        consumer = Consumer(doomed, [queue], prefetch_count=4,
                            callbacks=[lambda body, message: got.append(body["v"])])
        consumer.consume()
        deadline = time.monotonic() + 10
        while len(got) < 4 and time.monotonic() < deadline:
            doomed.drain_events(timeout=1)
        wait_until(lambda: len(owned(zk_client, layout, "dies")) == 4, 10)
        assert len(set(owners(zk_client, layout, "dies"))) == 1
        # The process dies: its session ends, without kombu closing anything.
        doomed.transport.handle.client.stop()
        try:
            doomed.release()
        except Exception:   # its session is gone: closing may complain
            pass
        wait_until(lambda: owned(zk_client, layout, "dies") == [], 15,
                   message="the dead consumer's inbox was not recovered")
        publish(survivor, queue, ["late"])
        rest: list[Any] = []
        with Consumer(survivor, [queue], prefetch_count=1,
                      callbacks=[lambda body, message: (rest.append(body["v"]),
                                                        message.ack())]):
            drain_until(survivor, rest, 7, 30)
    assert rest == [0, 1, 2, 3, 4, 5, "late"]
    assert owned(zk_client, layout, "dies") == []
    # Its inbox directory went with it.
    assert len(zk_client.get_children(layout.owned("dies"))) == 0 or all(
        not zk_client.get_children(f"{layout.owned('dies')}/{c}")
        for c in zk_client.get_children(layout.owned("dies")))


def test_a_message_given_later_but_first_in_line_overtakes_a_deep_inbox(
        zk_url: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer looking ahead holds messages beyond its prefetch. One of a
    higher priority, given to it after them, is delivered before them, as it
    would be from the queue: it waits for room in the inbox, not behind what
    the inbox holds."""
    from celery_zk.broker import credit

    monkeypatch.setattr(credit, "HOLD", 60.0)   # nothing goes back meanwhile
    queue = queue_of("overtake")
    layout = layout_of(zk_url)
    with looking_ahead(zk_url, zk_client, "overtake") as (publisher, deep, got, held):
        credit = 2 * ZKOptions.lookahead
        publish(publisher, queue, list(range(100, 100 + credit)))
        drain_until(deep, got, 62, 10, poll=0.1)
        assert got[60:] == [100, 101]   # in hand: the channel is full
        # The rest is in the inbox, which is full: the urgent one waits in line.
        wait_until(lambda: waiting(zk_client, layout, "overtake") == [], 10,
                   message="the inbox did not take its credit's worth")
        publish(publisher, queue, [999], priorities=[9])
        time.sleep(0.3)
        assert len(waiting(zk_client, layout, "overtake")) == 1
        held.pop(0).ack()   # room for one: the dispatcher gives it
        inbox = deep.transport.inbox("overtake")
        wait_until(lambda: any(parse_message_name(name).priority == 9  # type: ignore[union-attr]
                               for name in inbox.arrivals), 10,
                   message="the urgent message never reached the inbox")
        drain_until(deep, got, 63, 10, poll=0.1)
        assert got[62:] == [999], got[62:]
        for message in held:
            message.ack()


def test_a_dead_consumers_deep_inbox_goes_back_a_batch_per_multi(
        zk_url: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deep inbox (a worker looking ahead holds up to lookahead x its prefetch)
    goes back REQUEUE_BATCH messages per multi, not one synced write each, and
    every message still to its place."""
    from celery_zk.broker.acks import REQUEUE_BATCH

    queue = queue_of("deep")
    layout = layout_of(zk_url)
    total = REQUEUE_BATCH + 72   # two multis
    singles: list[str] = []   # what was moved, and how (the dying side's tries fail)
    batches: list[int] = []
    real_one, real_many = Acks.requeue, Acks.requeue_many

    def one(self: Acks, path: str, *args: Any, **kwargs: Any) -> bool:
        moved = real_one(self, path, *args, **kwargs)
        if moved:
            singles.append(path)
        return moved

    def many(self: Acks, paths: list[str]) -> int:
        moved = real_many(self, paths)
        batches.append(moved)
        return moved
    monkeypatch.setattr(Acks, "requeue", one)
    monkeypatch.setattr(Acks, "requeue_many", many)
    with Connection(zk_url) as survivor:
        recovery_leader(survivor)
        publish(survivor, queue, list(range(total)))
        doomed = Connection(apart(zk_url, "deep-doomed"))
        got: list[Any] = []
        consumer = Consumer(doomed, [queue], prefetch_count=total,
                            callbacks=[lambda body, message: got.append(body["v"])])
        consumer.consume()
        drain_until(doomed, got, total, 20)
        wait_until(lambda: len(owned(zk_client, layout, "deep")) == total, 10)
        doomed.transport.handle.client.stop()   # dies: its session ends
        try:
            doomed.release()
        except Exception:
            pass
        wait_until(lambda: owned(zk_client, layout, "deep") == [], 15,
                   message="the dead consumer's inbox was not recovered")
        assert total in batches and singles == [], (batches, len(singles))
        assert len(waiting(zk_client, layout, "deep")) == total
        rest: list[Any] = []
        with Consumer(survivor, [queue], prefetch_count=50,
                      callbacks=[lambda body, message: (rest.append(body["v"]),
                                                        message.ack())]):
            drain_until(survivor, rest, total, 30)
    assert rest == list(range(total))


def test_messages_stored_before_0_2_wait_for_the_upgrade_and_then_run_in_order(
        zk_url: str, zk_client: KazooClient, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing in the message path reads the forms of celery_zk before 0.2 (a
    body in its node: waiting in a bucket or flat in unowned/, or claimed flat
    in owned/): a dispatcher finding one says so once and leaves it. `celery
    zk upgrade` stores them anew, each in its place, and they run; a claimed
    one only once its owner's session has ended."""
    layout = layout_of(zk_url)
    queue = queue_of("upgrade")
    with Connection(zk_url) as earlier:   # declared by an earlier release, which made
        queue(earlier.channel()).declare()   # none of these
        for directory in ("offers", "consumers", "chunks"):
            zk_client.delete(f"{layout.queue('upgrade')}/{directory}")
    with Connection(zk_url) as conn:
        bucket = layout.bucket("upgrade", "p9-0000000000")
        zk_client.ensure_path(bucket)

        def stored(value: Any) -> bytes:
            with Connection(zk_url) as other:   # a message as kombu encodes it
                captured: list[bytes] = []
                channel = other.channel()
                original = channel._put

                def capture(queue_name: str, message: dict[str, Any], **kwargs: Any) -> None:
                    captured.append(json.dumps(message).encode())
                channel._put = capture   # type: ignore[method-assign]
                Producer(channel).publish({"v": value}, exchange=queue.exchange,
                                          routing_key="upgrade")
                channel._put = original   # type: ignore[method-assign]
                return captured[0]

        zk_client.create(f"{bucket}/m9-0000000000-{'a' * 16}-0000000005", stored("waiting-old"))
        zk_client.create(f"{layout.unowned('upgrade')}/m9-{'c' * 16}-", stored("flat-old"),
                         sequence=True)
        held = f"m9-0000000000-{'b' * 16}-0000000000"
        zk_client.create(f"{layout.owned('upgrade')}/c00dead~{held}", stored("owned-old"))
        alive = f"m9-0000000000-{'d' * 16}-0000000001"
        live_id, _ = conn.transport.session.ensure_registered()
        zk_client.create(f"{layout.owned('upgrade')}/{live_id}~{alive}",
                         stored("owned-by-a-live-one"))
        publish(conn, queue, ["new"])
        got: list[Any] = []
        with caplog.at_level(logging.ERROR, logger="celery_zk.broker.dispatcher"), \
                Consumer(conn, [queue], prefetch_count=1,
                         callbacks=[lambda body, message: (got.append(body["v"]),
                                                           message.ack())]):
            drain_until(conn, got, 1, 30)
            with pytest.raises(socket.timeout):
                conn.drain_events(timeout=1)
        assert got == ["new"]
        assert caplog.text.count("celery -A proj zk upgrade") == 1, caplog.text

        done = upgrade(conn.transport.queues)
        assert done.moved == {"upgrade": 3} and done.owned_by_live == {"upgrade": 1}
        assert upgrade(conn.transport.queues).moved == {}   # again: nothing to do
        assert {"offers", "consumers", "chunks"} <= set(
            zk_client.get_children(layout.queue("upgrade")))
        with Consumer(conn, [queue], prefetch_count=1,
                      callbacks=[lambda body, message: (got.append(body["v"]),
                                                        message.ack())]):
            drain_until(conn, got, 4, 30)
    # Each in its place, by its first sequence: the owned one's 0, the flat
    # one's (in bucket 0 now) 1 or 2, the waiting one's 5.
    assert got == ["new", "owned-old", "flat-old", "waiting-old"]
    assert waiting(zk_client, layout, "upgrade") == []


def test_purge_deletes_names_and_bodies_a_few_hundred_per_multi(
        zk_url: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = layout_of(zk_url)
    with Connection(zk_url) as conn:
        publisher = conn.transport.publisher
        publisher.put_batch([publisher.new_message("purged", b'{"v": 1}', None)
                             for _ in range(1000)])
        transactions = 0
        client = conn.transport.handle.client
        real = client.transaction

        def counting() -> Any:
            nonlocal transactions
            transactions += 1
            return real()
        monkeypatch.setattr(client, "transaction", counting)
        assert conn.default_channel.queue_purge("purged") == 1000
    assert transactions <= 1000 // 256 + 1
    assert waiting(zk_client, layout, "purged") == []
    for twin in zk_client.get_children(layout.bodies("purged")):
        assert zk_client.get_children(f"{layout.bodies('purged')}/{twin}") == []


def test_bodies_are_written_once_and_only_names_move(
        zk_url: str, zk_client: KazooClient) -> None:
    """The body's node is made by the publish and deleted by the ack: giving a
    message to a consumer moves only its (empty) name."""
    layout = layout_of(zk_url)
    queue = queue_of("names")
    with Connection(zk_url) as conn:
        publish(conn, queue, ["x"])
        (name,) = waiting(zk_client, layout, "names")
        message = parse_message_name(name)
        assert message is not None
        body = layout.body("names", message)
        assert body is not None
        _, before = zk_client.get(body)
        got: list[Any] = []
        with Consumer(conn, [queue], prefetch_count=1,
                      callbacks=[lambda body, message: got.append(message)]):
            deadline = time.monotonic() + 10
            while not got and time.monotonic() < deadline:
                conn.drain_events(timeout=1)
            (path,) = owned(zk_client, layout, "names")
            assert zk_client.get(path)[0] == b""
            _, after = zk_client.get(body)
            assert (after.czxid, after.mzxid) == (before.czxid, before.mzxid)
            got[0].ack()
            wait_until(lambda: zk_client.exists(body) is None, 5)
    assert owned(zk_client, layout, "names") == []


def test_a_consumer_that_leaves_and_joins_while_its_dispatcher_stops_is_served(
        zk_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone consumer leaves its queue and joins again (its session expired, or its
    queue was swept and declared again) while its dispatcher thread is on its way
    out, stopping its watches. The thread must look again before it goes: else
    the queue has no dispatcher until its consumers change, which for a lone
    consumer (a worker's pidbox queue) is never, and it hears nothing again (the
    nemesis found such a worker with hand-off off)."""
    queue = queue_of("rejoin")
    stopping = threading.Event()
    real_stop = Dispatcher._stop_watches

    def slow_stop(self: Dispatcher) -> None:
        if self.queue == "rejoin" and not stopping.is_set():
            stopping.set()
            time.sleep(1.0)   # a slow unwatch: the join below lands meanwhile
        real_stop(self)
    monkeypatch.setattr(Dispatcher, "_stop_watches", slow_stop)
    got: list[Any] = []
    url = f"{zk_url}?handoff=false"   # only the dispatcher gives: no offers to fall back on
    with Connection(url) as conn, Consumer(conn, [queue], prefetch_count=2,
                                           callbacks=[lambda body, m: (got.append(body),
                                                                       m.ack())]):
        publish(conn, queue, ["before"])
        conn.drain_events(timeout=5)
        inbox = conn.transport.inbox("rejoin")
        dispatcher, consumer_id = inbox.member.dispatcher(), inbox.consumer_id
        assert consumer_id is not None
        wait_until(lambda: leaders("rejoin") == [dispatcher], 5, message="not dispatching")
        wake = dispatcher.members[consumer_id]
        dispatcher.leave(consumer_id)
        assert stopping.wait(5), "the dispatcher thread did not stop"
        dispatcher.join(consumer_id, wake)   # while the old thread stops its watches
        time.sleep(1.5)
        publish(conn, queue, ["after"])
        drain_until(conn, got, 2, 10, poll=0.5)
    assert [body["v"] for body in got] == ["before", "after"]


def test_entries_both_listed_and_reported_by_the_watch_are_delivered_once(
        zk_url: str, zk_client: KazooClient) -> None:
    """An inbox lists itself when it cannot trust its watch (at its start, after
    a session change or a pause); entries made during that listing's round trip
    are in the listing and also reported by the watch. Each is delivered once
    (the nemesis saw a restarted worker run its first 8 messages twice)."""
    with Connection(zk_url) as conn:
        queue = conn.SimpleQueue("listed-and-watched")
        queue.put("first")
        message = queue.get(timeout=10)
        message.ack()
        transport = conn.transport
        inbox = transport.inboxes["listed-and-watched"]
        path = transport.layout.inbox("listed-and-watched", inbox.consumer_id)
        for n in range(3):
            queue.put(n)
        layout = Layout("/")   # zk_client is chrooted at the URL's path
        wait_until(lambda: len(zk_client.get_children(
            layout.inbox("listed-and-watched", inbox.consumer_id))) == 3, 30,
            message="the dispatcher never gave the three to the inbox")
        client = transport.handle.client
        real = client.get_children

        def listing(at: str, *args: Any, **kwargs: Any) -> Any:
            names = real(at, *args, **kwargs)
            if at == path:   # as if each was made during the round trip
                inbox.arrivals.extend(names)
            return names

        client.get_children = listing   # type: ignore[method-assign]
        try:
            inbox.stale = True   # list again, as after a session change
            got = []
            while True:
                try:
                    message = queue.get(timeout=2)
                except queue.Empty:
                    break
                got.append(message.payload)
                message.ack()
        finally:
            del client.get_children
        assert sorted(got) == [0, 1, 2]


def test_held_acks_go_at_once_only_when_they_keep_the_inbox_from_a_refill(
        zk_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer running low sends its held acks at once when they are what
    keeps the dispatcher from refilling its inbox (it counts an entry until
    its ack lands); otherwise they wait for ACK_HOLD, to go together. A
    worker's remote-control queue, looked at on every turn of a prefork
    worker's event loop, sent every ack alone (0.77 transactions per task,
    not 0.1), and so did a trickle handed over one message at a time."""
    from celery_zk.broker import acks

    monkeypatch.setattr(acks, "ACK_HOLD", 60.0)   # only a flush sends them here
    work, idle = queue_of("work"), queue_of("idle")
    # No offers: an offer is a deferred write too, and the background thread
    # sends everything held when one is due (5 ms), acks included. No
    # lookahead: the credit stays the prefetch.
    with Connection(f"{zk_url}?handoff=false&lookahead=1") as conn:
        publish(conn, work, list(range(4)))
        got: list[Any] = []
        messages: list[Any] = []
        with Consumer(conn, [work, idle], prefetch_count=4,
                      callbacks=[lambda body, message: (got.append(body["v"]),
                                                        messages.append(message))]):
            drain_until(conn, got, 4, 20)
            assert sorted(got) == [0, 1, 2, 3]
            acks = conn.transport.acks
            sent: list[int] = []
            real = acks._send_ack_batch
            monkeypatch.setattr(acks, "_send_ack_batch",
                                lambda node, paths: (sent.append(len(paths)), real(node, paths)))
            session = conn.transport.session
            consumer_id = session.ensure_registered()[0]
            layout = conn.transport.layout
            messages[0].ack()
            assert acks.holds_acks(layout.inbox("work", consumer_id)) == 1
            conn.transport.inbox("work").fill(0)   # one of 4: room to refill
            assert sent == []
            for message in messages[1:]:
                message.ack()
            assert acks.holds_acks(layout.inbox("work", consumer_id)) == 4
            assert not acks.holds_acks(layout.inbox("idle", consumer_id))
            conn.transport.inbox("idle").fill(0)   # empty, and none of the acks are its
            assert sent == []
            conn.transport.inbox("work").fill(0)   # empty, and waiting for its refill
            assert sent == [4]
            assert not acks.holds_acks(layout.inbox("work", consumer_id))


def test_an_inbox_deleted_by_hand_is_made_again_and_served(
        zk_url: str, zk_client: KazooClient, drainers: list[Drainer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator deletes a live consumer's inbox: its consumer makes it again
    at once, and the dispatcher (another process) gives to it again. (The
    consumer ignored the event: each multi giving to it was refused, and
    the queue stood still.)"""
    queue = queue_of("remade")
    lead = Drainer(zk_url, queue, "lead", prefetch=1, hold=0.05)
    drainers.append(lead)
    lead.start()
    assert lead.ready.wait(10)
    wait_until(lambda: len(leaders("remade")) == 1, 10, message="no dispatcher")
    other = Drainer(zk_url, queue, "other", prefetch=4)
    drainers.append(other)
    other.start()
    assert other.ready.wait(10)
    layout = layout_of(zk_url)
    wait_until(lambda: len(zk_client.get_children(layout.owned("remade"))) == 2, 10,
               message="no second inbox")
    [inbox] = [c for c in zk_client.get_children(layout.owned("remade"))
               if c not in leaders("remade")[0].members]
    assignments = count_assignments(monkeypatch)
    zk_client.delete(layout.inbox("remade", inbox), recursive=True)
    wait_until(lambda: zk_client.exists(layout.inbox("remade", inbox)), 10,
               message="the inbox was not made again")
    with Connection(zk_url) as conn:
        publish(conn, queue, list(range(100)))
    wait_until(lambda: len(lead.got) + len(other.got) >= 100, 30,
               message=lambda: f"delivered {len(lead.got)} + {len(other.got)}")
    assert len(other.got) > 50, (len(lead.got), len(other.got))
    assert sum(refused for _, refused in assignments) <= 1, len(assignments)
