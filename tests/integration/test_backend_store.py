"""The zk:// backend against a real ZooKeeper, driven in-process (no worker needed).

Waiting, reconnects and expiry depend on timing a worker would only blur, so
these tests write results through the backend's own API.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, states
from kazoo.exceptions import ConnectionClosedError, ConnectionLoss
from kazoo.protocol.connection import _CONNECTION_DROP

import celery_zk.backend.result_consumer as result_consumer
from celery_zk.backend import ZooKeeperBackend, expiry
from celery_zk.backend.expiry import HOUR, RESULT, expiry_hour

from .spies import count_calls
from .workers import wait_until


@pytest.fixture
def app(zk_url: str) -> Iterator[Celery]:
    client_app = Celery("store", broker="memory://", backend=zk_url, set_as_current=False)
    client_app.conf.result_expires = 24 * HOUR
    yield client_app
    client_app.backend.close()
    client_app.close()


@pytest.fixture
def backend(app: Celery) -> ZooKeeperBackend:
    b = app.backend
    assert isinstance(b, ZooKeeperBackend)
    return b


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(path, thread name) of every done-node read the result consumer starts."""
    calls: list[tuple[str, str]] = []
    real = result_consumer.read_async

    def counting(client: Any, path: str, watch: Any = None) -> Any:
        calls.append((path, threading.current_thread().name))
        return real(client, path, watch)

    monkeypatch.setattr(result_consumer, "read_async", counting)
    return calls


def store_later(backend: ZooKeeperBackend, delay: float, task_id: str, value: Any,
                state: str = states.SUCCESS) -> threading.Timer:
    timer = threading.Timer(delay, backend.store_result, (task_id, value, state))
    timer.start()
    return timer


def test_result_written_before_get_is_returned(app: Celery, backend: ZooKeeperBackend) -> None:
    backend.store_result("early", {"v": 1}, states.SUCCESS)
    assert app.AsyncResult("early").get(timeout=5) == {"v": 1}
    assert app.AsyncResult("early").ready()


def test_get_is_woken_by_the_watch_without_polling(
        app: Celery, backend: ZooKeeperBackend, reads: list[tuple[str, str]]) -> None:
    result = app.AsyncResult("late")
    timer = store_later(backend, 2.0, "late", "done")
    started = time.monotonic()
    assert result.get(timeout=10) == "done"
    waited = time.monotonic() - started
    timer.join()
    assert waited > 1.9   # not before it was written (the reads below show what woke it)
    # Two reads in two seconds: the first (arms the watch), the one the watch woke.
    path = backend.result_path("late")
    assert [p for p, _ in reads] == [path, path], reads
    # The woken read starts in the watch callback, not after the waiter wakes.
    waiter = threading.current_thread().name
    assert reads[0][1] == waiter and reads[1][1] != waiter, reads


@pytest.mark.parametrize("how", ["reply lost", "refused"])
def test_a_woken_read_lost_with_the_connection_is_read_again(
        app: Celery, backend: ZooKeeperBackend, monkeypatch: pytest.MonkeyPatch,
        how: str) -> None:
    real = result_consumer.read_async
    lost: list[str] = []

    def losing(client: Any, path: str, watch: Any = None) -> Any:
        started = real(client, path, watch)
        if threading.current_thread() is threading.main_thread():
            return started
        lost.append(path)   # the read a watch callback started
        if how == "refused":   # kazoo raises at once when the client is closing
            raise ConnectionClosedError("Connection has been closed")
        failed = client.handler.async_result()
        failed.set_exception(ConnectionLoss())
        return failed

    monkeypatch.setattr(result_consumer, "read_async", losing)
    timer = store_later(backend, 0.5, "lossy", "kept")
    assert app.AsyncResult("lossy").get(timeout=10) == "kept"
    timer.join()
    assert lost == [backend.result_path("lossy")]


def test_state_changes_re_arm_the_watch(app: Celery, backend: ZooKeeperBackend) -> None:
    backend.store_result("steps", None, states.STARTED)
    seen: list[str] = []
    timers = [store_later(backend, 0.3, "steps", {"p": 1}, states.STARTED),
              store_later(backend, 0.8, "steps", 7, states.SUCCESS)]
    assert app.AsyncResult("steps").get(timeout=10, on_message=lambda m: seen.append(
        m["status"])) == 7
    for timer in timers:
        timer.join()
    assert seen[0] == states.STARTED and seen[-1] == states.SUCCESS


def test_success_is_not_overwritten(app: Celery, backend: ZooKeeperBackend) -> None:
    backend.store_result("once", 1, states.SUCCESS)
    backend.store_result("once", None, states.STARTED)  # a late duplicate run
    assert app.AsyncResult("once").get(timeout=5) == 1
    assert backend.get_task_meta("once", cache=False)["status"] == states.SUCCESS


def test_a_new_result_is_one_multi_and_missing_directories_are_remade(
        app: Celery, backend: ZooKeeperBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    client = backend.client
    now = time.time()
    backend.clock = lambda: now
    backend.store_result("once", 1, states.SUCCESS)  # makes its shard and hour directories
    entry = backend.layout.expiry_entry(expiry_hour(now), RESULT, "once")
    client.delete(backend.result_path("once"))
    client.delete(entry)  # both gone, their directories left
    calls = count_calls(monkeypatch, client, "transaction", "get_async")

    backend.store_result("once", 2, states.SUCCESS)
    assert calls == ["transaction"]  # no read first: one round trip

    # cleanup() removes emptied hour directories; the next write makes them again.
    client.delete(backend.result_path("once"))
    client.delete(backend.layout.expiry, recursive=True)
    calls.clear()
    backend.store_result("once", 3, states.SUCCESS)
    assert calls == ["transaction", "transaction"]  # failed on the missing directory, then again
    assert app.AsyncResult("once").get(timeout=5) == 3
    assert len(client.get_children(backend.layout.expiry)) == 1


def test_watches_are_re_armed_after_reconnect(
        app: Celery, backend: ZooKeeperBackend, reads: list[tuple[str, str]]) -> None:
    result = app.AsyncResult("across-reconnect")
    box: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: box.update(value=result.get(timeout=20)))
    waiter.start()
    wait_until(lambda: len(reads) >= 1, 5)  # watch armed
    client = backend.client
    dropped = threading.Event()
    client.add_listener(lambda state: dropped.set() if state != "CONNECTED" else None)
    client._call(_CONNECTION_DROP, None)  # kazoo's own test hook: drops the socket
    wait_until(dropped.is_set, 5)
    wait_until(lambda: client.connected, 10)
    # Written through another session: only a re-armed watch can wake the waiter.
    other = Celery("writer", broker="memory://", backend=backend.url, set_as_current=False)
    try:
        other.backend.store_result("across-reconnect", "still here", states.SUCCESS)
    finally:
        other.backend.close()
    waiter.join(15)
    assert box.get("value") == "still here"


def test_get_many_waits_on_watches(app: Celery, backend: ZooKeeperBackend) -> None:
    backend.store_result("m0", 0, states.SUCCESS)
    timers = [store_later(backend, 0.2 * i, f"m{i}", i) for i in range(1, 4)]
    got = dict(backend.get_many([f"m{i}" for i in range(4)], timeout=10))
    for timer in timers:
        timer.join()
    assert {k: v["result"] for k, v in got.items()} == {f"m{i}": i for i in range(4)}
    with pytest.raises(Exception, match="timed out"):
        list(backend.get_many(["never"], timeout=0.3))


def test_cleanup_removes_expired_results_and_only_those(
        app: Celery, backend: ZooKeeperBackend) -> None:
    now = time.time()
    expires = 24 * HOUR
    for task_id in ("old-1", "old-2"):
        backend.store_result(task_id, task_id, states.SUCCESS)
    # Same real write time, but indexed two days later: not expired yet then.
    backend.clock = lambda: now + 2 * expires
    backend.store_result("new", "new", states.SUCCESS)
    app.GroupResult("future-group", [app.AsyncResult("new")]).save(backend=backend)

    backend.clock = lambda: now + expires + 2 * HOUR
    backend.cleanup()

    assert app.AsyncResult("old-1").state == states.PENDING
    assert app.AsyncResult("old-2").state == states.PENDING
    assert app.AsyncResult("new").get(timeout=5) == "new"
    assert backend.restore_group("future-group", cache=False) is not None
    # Only the not-yet-expired hour is left in the index.
    assert backend.client.get_children(backend.layout.expiry) == [
        f"h{int((now + 2 * expires) // HOUR):010d}"]


def test_cleanup_keeps_a_node_rewritten_since_its_entry(
        app: Celery, backend: ZooKeeperBackend) -> None:
    now = time.time()
    # Indexed in an hour two days ago, but the node itself was written just now
    # (as after a rewrite): the stale entry goes, the node stays.
    backend.clock = lambda: now - 2 * 24 * HOUR
    backend.store_result("rewritten", "kept", states.SUCCESS)
    backend.clock = time.time
    backend.cleanup()
    assert app.AsyncResult("rewritten").get(timeout=5) == "kept"
    assert backend.client.get_children(backend.layout.expiry) == []


def test_cleanup_pipelines_its_listings_and_deletes(
        app: Celery, backend: ZooKeeperBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cost must not grow by one round trip per shard or per index entry."""
    now = time.time()
    ids = [f"expired-{i}" for i in range(40)]  # spread over ~40 of the 256 shards
    for task_id in ids:
        backend.store_result(task_id, 1, states.SUCCESS)
    backend.clock = lambda: now + 2 * 24 * HOUR  # all of them are past result_expires
    client = backend.client
    hour = backend.layout.expiry_bucket(expiry_hour(now))
    shards = len(client.get_children(hour))
    calls = count_calls(monkeypatch, client, "get_children", "delete", "transaction")
    backend.cleanup()
    made, calls[:] = list(calls), []
    assert all(app.AsyncResult(task_id).state == states.PENDING for task_id in ids)
    # Blocking calls (a round trip each): listing expiry/ and the hour, deleting the
    # hour. The shard listings and deletes are pipelined asynchronous calls, and
    # the results and index entries are deleted by multis, one per group of shards
    # for each (not a request per node).
    assert made.count("get_children") == 2
    assert made.count("delete") == 1
    groups = -(-shards // expiry.SHARD_GROUP)
    assert 0 < made.count("transaction") <= 2 * groups


def test_a_batch_with_a_rewritten_node_is_redone_one_by_one(backend: ZooKeeperBackend) -> None:
    paths = [backend.result_path(f"b{i}") for i in range(5)]
    for i in range(5):
        backend.store_result(f"b{i}", None, states.STARTED)
    targets = [(path, backend.client.exists(path).version) for path in paths]
    backend.store_result("b2", "rewritten", states.SUCCESS)  # after its version was read
    assert backend._expiry._delete_batched(targets) == 4
    assert [backend.client.exists(path) is not None for path in paths] == [
        False, False, True, False, False]


def test_forget_and_group_delete(app: Celery, backend: ZooKeeperBackend) -> None:
    backend.store_result("f", 1, states.SUCCESS)
    backend.forget("f")
    assert app.AsyncResult("f").state == states.PENDING
    backend.forget("f")  # twice is fine
    group = app.GroupResult("g1", [app.AsyncResult("f")])
    group.save(backend=backend)
    assert backend.restore_group("g1", cache=False).results[0].id == "f"
    backend.delete_group("g1")
    assert backend.restore_group("g1", cache=False) is None


def test_chord_counter_counts_each_part_once(backend: ZooKeeperBackend) -> None:
    from celery_zk.backend.chord import ChordCounter

    counter = ChordCounter(backend.client, backend.layout, "chord-1")

    def value() -> int:   # the counter's node, as its multis keep it
        return int(backend.client.get(counter.path)[0] or b"0")
    assert [counter.increment(f"part-{i}", i) for i in range(3)] == [
        (1, None, False, False), (2, None, False, False), (3, None, False, False)]
    # a redelivered header task
    assert counter.increment("part-1") == (None, None, False, False)
    assert value() == 3
    assert counter.set_size(5)   # Celery's set_chord_size: the parts it waits for
    assert counter.increment("part-4", 4) == (4, 5, False, False)
    counter.add()                # Task.add_to_chord: one more part to wait for
    assert counter.increment("part-3", 3) == (5, 6, False, False)
    assert counter.increment("part-3", 3) == (None, 6, False, False)   # not complete yet
    assert counter.parts() == [f"part-{i}" for i in range(5)]   # header order
    assert value() == 5
    assert not ChordCounter(backend.client, backend.layout, "no-such").set_size(2)
    counter.finish()
    # a finished run counts nothing
    assert counter.increment("part-5") == (None, 6, False, False)
    counter.start(lazy=True, fresh=False)   # the chord applied again: a new run
    assert value() == 0 and counter.parts() == []
    assert counter.increment("part-0", 0) == (1, None, True, False)

    racing = ChordCounter(backend.client, backend.layout, "chord-2")
    counts: list[int | None] = []
    threads = [threading.Thread(target=lambda i=i: counts.append(racing.increment(f"p{i}")[0]))
               for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(c for c in counts if c is not None) == list(range(1, 21))


def test_a_part_run_again_after_the_last_count_finds_the_run_stalled(
        backend: ZooKeeperBackend) -> None:
    """Every part counted, no body sent (its sender stopped): a part that runs
    again says so, and only until the run is finished."""
    from celery_zk.backend.chord import ChordCounter

    counter = ChordCounter(backend.client, backend.layout, "chord-3")
    counter.start(lazy=False, fresh=True)   # the chord is applied
    assert counter.set_size(2)
    assert counter.increment("p0", 0) == (1, 2, False, False)
    assert counter.increment("p1", 1) == (2, 2, False, False)   # the last: sends the body
    assert counter.increment("p1", 1) == (None, 2, False, True)  # ...it never did
    assert counter.increment("p0", 0) == (None, 2, False, True)
    counter.finish()
    assert counter.increment("p1", 1) == (None, 2, False, False)


def test_a_chord_with_a_repeated_header_task_id_is_refused_before_sending(
        app: Celery, backend: ZooKeeperBackend) -> None:
    """Each header task is counted once, so two with one id would never complete."""
    from celery import chord

    @app.task(name="store.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    header = [add.s(1, 1).set(task_id="twice"), add.s(2, 2).set(task_id="twice"),
              add.s(3, 3)]
    with pytest.raises(ValueError, match=r"twice appear more than once.*Nothing was sent"):
        chord(header)(add.s(0))
    client = backend.client
    assert not client.exists(backend.layout.chords) or client.get_children(
        backend.layout.chords) == []   # no counter made
    with app.connection_for_write() as conn:   # no header task was published
        assert conn.default_channel.queue_declare("celery", passive=False).message_count == 0


def test_a_new_level_is_made_once_whole_and_otherwise_shard_by_shard(
        app: Celery, backend: ZooKeeperBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first write under a root makes every shard (in the background); the
    other writers meeting the missing level at once make only their own."""
    layout, client = backend.layout, backend.client
    hour = backend.layout.expiry_bucket(expiry_hour(time.time()))
    creates = count_calls(monkeypatch, client, "create_async")
    racers = [ZooKeeperBackend(app=app, url=backend.url) for _ in range(8)]
    try:
        threads = [threading.Thread(target=racer.store_result, args=(f"race-{i}", i,
                                                                      states.SUCCESS))
                   for i, racer in enumerate([backend, *racers])]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for i in range(len(threads)):
            assert app.AsyncResult(f"race-{i}").get(timeout=5) == i
        wait_until(lambda: len(client.get_children(layout.results)) == 256
                   and len(client.get_children(hour)) == 256, timeout=10,
                   message="the levels were not filled")
        # Nine writers, two levels: one whole fill of each (2 x 256) plus a few
        # creates per writer (levels, shards, the root's directories), not 9 x 512.
        assert len(creates) < 2 * 256 + 9 * 16
    finally:
        for racer in racers:
            racer.close()
