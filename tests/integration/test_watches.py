"""Persistent recursive watches: what they wake, when they go away, what replaces them."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient, KazooState
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_zk.zk.config import parse_url
from celery_zk.zk.reads import MultiRead
from celery_zk.zk.session import ClientHandle
from celery_zk.zk.watches import NODE_CREATED, NODE_DELETED, TreeWatches

from .sessions import apart
from .workers import wait_until


def drop_connection(client: KazooClient) -> None:
    """Break the client's TCP connection (not its session), as a network blip does."""
    reconnected = threading.Event()

    def listener(state: KazooState) -> bool:
        if state == KazooState.CONNECTED:
            reconnected.set()
            return True
        return False

    client.add_listener(listener)
    client._connection._socket.shutdown(socket.SHUT_RDWR)
    assert reconnected.wait(15), "kazoo did not reconnect"


@pytest.fixture
def handle(zk_url: str) -> Iterator[ClientHandle]:
    handle = ClientHandle(parse_url(zk_url))
    yield handle
    handle.close()


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[int, str, str]] = []

    def __call__(self, event_type: int, name: str) -> None:
        self.events.append((event_type, name, threading.current_thread().name))


def watched(handle: ClientHandle, name: str) -> tuple[str, TreeWatches, Recorder]:
    """A fresh directory under the test's root, with a tree watch and its recorder."""
    path = f"{handle.settings.root}/{name}/unowned"
    handle.client.ensure_path(path)
    watches = TreeWatches(handle)
    recorder = Recorder()
    watches.watch(path, recorder)
    return path, watches, recorder


def connection_thread(client: KazooClient) -> str:
    """The name of kazoo's connection thread (its default name carries
    ``(zk_loop)`` on Python 3.10 and newer only)."""
    return client._connection._connection_routine.name


def count_raw_events(client: KazooClient) -> list[Any]:
    """Every watch event the client's connection reads, ours or kazoo's."""
    seen: list[Any] = []
    connection = client._connection
    inner = connection._read_watch_event

    def counting(buffer: bytes, offset: int) -> Any:
        seen.append(offset)
        return inner(buffer, offset)

    connection._read_watch_event = counting
    return seen


def test_tree_watch_reports_each_child_by_name_until_removed(handle: ClientHandle) -> None:
    client = handle.client
    path, watches, recorder = watched(handle, "tree")
    assert watches.active(path)
    raw = count_raw_events(client)
    first = client.create(f"{path}/m-", sequence=True).rpartition("/")[2]
    second = client.create(f"{path}/m-", sequence=True).rpartition("/")[2]
    client.delete(f"{path}/{first}")
    wait_until(lambda: len(recorder.events) == 3, 10, 0.02, "three events did not come")
    assert [(t, n) for t, n, _ in recorder.events] == [
        (NODE_CREATED, first), (NODE_CREATED, second), (NODE_DELETED, first)]
    # On kazoo's connection thread, not its event thread: no hand-off per event.
    assert {thread for _, _, thread in recorder.events} == {connection_thread(client)}
    assert watches.unwatch(path, recorder)
    assert not watches.active(path)
    client.sync(path)   # the removal has been processed
    before = len(raw)
    client.create(f"{path}/m-", sequence=True)
    client.sync(path)
    time.sleep(0.2)
    assert len(raw) == before, "the server still sends events after the removal"


def test_a_burst_of_events_is_read_from_the_buffer_in_order_before_the_reply(
        handle: ClientHandle) -> None:
    """A multi that creates many nodes sends an event for each, then its reply:
    the events behind the first in the read buffer are read at once
    (compat.kazoo EVENT_BATCH), not one per turn of kazoo's loop, and none
    comes out of order or after the reply."""
    client = handle.client
    path, watches, recorder = watched(handle, "burst")
    raw = count_raw_events(client)   # the events kazoo's loop itself reads
    txn = client.transaction()
    names = [f"m{i:04d}" for i in range(300)]
    for name in names:
        txn.create(f"{path}/{name}")
    assert all(result == f"{path}/{name}" for result, name in zip(txn.commit(), names))
    # The reply came after every event, and the connection thread handled them first.
    assert [(t, n) for t, n, _ in recorder.events] == [(NODE_CREATED, n) for n in names]
    assert 1 <= len(raw) < len(names), len(raw)


def test_tree_watch_is_added_again_after_the_connection_drops(handle: ClientHandle) -> None:
    client = handle.client
    path, watches, recorder = watched(handle, "again")
    drop_connection(client)
    assert not watches.active(path)   # the server forgot it with the connection
    client.create(f"{path}/lost")
    client.sync(path)
    time.sleep(0.2)
    assert recorder.events == []
    watches.watch(path, recorder)
    client.create(f"{path}/seen")
    wait_until(lambda: [n for _, n, _ in recorder.events] == ["seen"], 10, 0.02,
               "'seen' was not reported")


def _expect_idle(conn: Connection) -> None:
    """Nothing to deliver: the consumer waits out the timeout, idle and armed."""
    with pytest.raises(socket.timeout):
        conn.drain_events(timeout=0.3)


def _publish(zk_url: str, queue: Queue, *bodies: Any) -> None:
    with Connection(apart(zk_url, "publisher")) as other:   # another process
        producer = Producer(other.channel())
        for body in bodies:
            producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key)


def test_a_consumer_learns_of_a_message_from_its_inbox_alone(
        zk_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """It never lists the queue: with a persistent watch on its inbox it lists
    nothing at all once watching."""
    queue = Queue("wake", Exchange("wake", "direct"), "wake")
    with Connection(zk_url) as conn:
        queue(conn.channel()).declare()
        transport = conn.transport
        listed: list[str] = []
        client = transport.handle.client
        original = client.get_children

        def get_children(path: str, *args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is threading.main_thread():   # the consumer's
                listed.append(path)
            return original(path, *args, **kwargs)

        monkeypatch.setattr(client, "get_children", get_children)
        got: list[Any] = []
        with Consumer(conn, [queue], callbacks=[lambda b, m: (got.append(b), m.ack())]):
            for expected in (1, 2, 3):
                _expect_idle(conn)
                listed.clear()
                _publish(zk_url, queue, {"n": expected})
                conn.drain_events(timeout=5)
                assert got[-1] == {"n": expected}
                unowned = transport.layout.unowned("wake")
                assert not any(path.startswith(unowned) for path in listed), listed
                if expected > 1:   # the first look lists once, to start
                    assert listed == [], listed


def test_consumer_gets_messages_published_across_a_connection_drop(zk_url: str) -> None:
    queue = Queue("blip", Exchange("blip", "direct"), "blip")
    with Connection(zk_url) as conn:
        queue(conn.channel()).declare()
        transport = conn.transport
        got: list[Any] = []
        with Consumer(conn, [queue], callbacks=[lambda b, m: (got.append(b), m.ack())]):
            for n in range(2):   # the second wake-up comes through the tree watch
                _expect_idle(conn)
                _publish(zk_url, queue, n)
                conn.drain_events(timeout=5)
            inbox = transport.inbox("blip")._inbox_path()
            assert transport.watches.active(inbox)
            drop_connection(transport.handle.client)
            _publish(zk_url, queue, "during")
            conn.drain_events(timeout=5)
            _publish(zk_url, queue, "after")
            conn.drain_events(timeout=5)
            assert transport.watches.active(inbox)   # re-added
        assert got == [0, 1, "during", "after"]


@pytest.mark.parametrize("handoff", ["false", "true"])
def test_a_new_message_is_read_once_and_never_on_kazoos_thread(
        zk_url: str, handoff: str) -> None:
    """Given by the dispatcher (handoff off), the message is read once, by the
    consuming thread; handed over (on), it is not read at all: its body came
    in its name. The tree watches that report it (the
    consumer's on its inbox, the dispatcher's on unowned/ and owned/) run on
    kazoo's connection thread, which must make no request: a request there
    writes to kazoo's wake-up socket, which only that thread drains, and with
    the socket full of other threads' wake-ups it blocks for good (seen as a
    worker that stopped consuming after a 1,000-task chord header)."""
    queue = Queue("early", Exchange("early", "direct"), "early")
    with Connection(f"{zk_url}?handoff={handoff}") as conn:
        queue(conn.channel()).declare()
        client = conn.transport.handle.client
        readers: list[str] = []
        on_loop: list[str] = []
        original_get, original_call = client.get_async, client._call
        loop = connection_thread(client)

        def get_async(path: str, *args: Any, **kwargs: Any) -> Any:
            if "/bodies/" in path:
                readers.append(threading.current_thread().name)
            return original_get(path, *args, **kwargs)

        def call(request: Any, async_object: Any) -> Any:
            if threading.current_thread().name == loop:
                on_loop.append(type(request).__name__)
            if isinstance(request, MultiRead):   # the body's read (celery_zk.zk.reads)
                readers.append(threading.current_thread().name)
            return original_call(request, async_object)

        client.get_async = get_async  # type: ignore[method-assign]
        client._call = call  # type: ignore[method-assign]
        got: list[Any] = []
        with Consumer(conn, [queue], callbacks=[lambda b, m: (got.append(b), m.ack())]):
            for n in range(3):
                _expect_idle(conn)
                readers.clear()
                _publish(zk_url, queue, n)
                conn.drain_events(timeout=5)
                assert len(readers) == (0 if handoff == "true" else 1), readers
                assert loop not in readers, readers
        assert got == [0, 1, 2]
        assert on_loop == []


def test_a_session_event_leaves_the_inbox_to_the_consuming_thread(zk_url: str) -> None:
    """reset() runs on kazoo's thread: it only flags, the consuming thread lists
    its inbox again before its next look, and nothing is delivered twice."""
    queue = Queue("reset", Exchange("reset", "direct"), "reset")
    with Connection(f"{zk_url}?handoff=false") as conn:
        queue(conn.channel()).declare()
        _publish(zk_url, queue, *range(30))
        got: list[Any] = []
        with Consumer(conn, [queue], callbacks=[lambda b, m: (got.append(b), m.ack())],
                      prefetch_count=4):
            conn.drain_events(timeout=5)
            inbox = conn.transport.inbox("reset")
            before = (list(inbox.buffer), set(inbox.taken))
            resetter = threading.Thread(target=inbox.reset)   # as kazoo's thread calls it
            resetter.start()
            resetter.join()
            assert (list(inbox.buffer), set(inbox.taken)) == before and inbox.stale
            while len(got) < 30:
                conn.drain_events(timeout=5)
        assert sorted(got) == list(range(30))


def test_a_requeue_from_a_pool_thread_goes_back_ahead_of_the_rest(zk_url: str) -> None:
    """A threads worker rejects on a pool thread: the message goes back to its
    place, and the dispatcher gives it again before everything after it."""
    queue = Queue("invalidate", Exchange("invalidate", "direct"), "invalidate")
    with Connection(f"{zk_url}?handoff=false") as conn:
        queue(conn.channel()).declare()
        _publish(zk_url, queue, *range(30))
        got: list[Any] = []
        held: list[Any] = []

        def on_message(body: Any, message: Any) -> None:
            got.append(body)
            if body == 0 and not held:
                held.append(message)   # requeued below, from another thread
            else:
                message.ack()

        with Consumer(conn, [queue], callbacks=[on_message], prefetch_count=1):
            conn.drain_events(timeout=5)
            assert held
            rejecter = threading.Thread(target=held[0].reject, kwargs={"requeue": True})
            rejecter.start()
            rejecter.join()
            conn.drain_events(timeout=5)
            assert got[-1] == 0   # requeued: back ahead of everything after it
            while len(got) < 31:
                conn.drain_events(timeout=5)
        assert sorted(got) == [0] + list(range(30))
