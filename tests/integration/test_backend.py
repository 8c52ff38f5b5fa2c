"""The zk:// result backend end to end: real ZooKeeper, real ``celery worker`` processes."""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chain, chord, group, states
from celery.exceptions import ChordError
from celery.result import GroupResult, ResultSet

from celery_zk.backend import ZooKeeperBackend
from celery_zk.exceptions import ResultTooLarge

from .workers import Worker, wait_until

ROOT = Path(__file__).resolve().parents[2]

#: In every cell of the version matrix (tox.ini).
pytestmark = pytest.mark.matrix

TASK = "proj.app."


@pytest.fixture
def app(zk_url: str) -> Iterator[Celery]:
    """A client app on the zk:// broker and backend; tasks are called by name."""
    client_app = Celery("client", broker=zk_url, backend=zk_url, set_as_current=False)
    client_app.conf.update(broker_connection_retry_on_startup=True,
                           result_backend_transport_options={"session_timeout": 6})
    yield client_app
    backend = client_app.backend
    assert isinstance(backend, ZooKeeperBackend)
    backend.close()
    client_app.close()


def sig(app: Celery, name: str, *args: Any, **options: Any) -> Any:
    return app.signature(TASK + name, args, **options)


def send(app: Celery, name: str, *args: Any, **kwargs: Any) -> Any:
    return app.send_task(TASK + name, args, kwargs)


def test_get_success_failure_retry(app: Celery, worker: Callable[..., Worker]) -> None:
    worker()
    assert send(app, "add", 2, 3).get(timeout=30) == 5

    failed = send(app, "fail", "kaboom")
    with pytest.raises(ValueError, match="kaboom"):
        failed.get(timeout=30)
    assert failed.state == states.FAILURE
    assert "kaboom" in failed.traceback
    assert isinstance(failed.get(propagate=False), ValueError)

    retried = send(app, "retry_once", "second run")
    assert retried.get(timeout=30) == "second run"
    assert retried.state == states.SUCCESS


def test_result_extended_and_started(app: Celery, worker: Callable[..., Worker]) -> None:
    worker(name="ext", env={"CELERY_ZK_TEST_RESULT_EXTENDED": "1",
                            "CELERY_ZK_TEST_TRACK_STARTED": "1"})
    app.conf.result_extended = True
    seen: list[str] = []
    result = app.send_task(TASK + "sleep_then", ("slept",), {"seconds": 1.0})
    # on_message sees every state the watch reports: STARTED, then SUCCESS.
    assert result.get(timeout=30, on_message=lambda m: seen.append(m["status"])) == "slept"
    assert seen == [states.STARTED, states.SUCCESS]

    retried = send(app, "retry_once", {"k": 1})
    assert retried.get(timeout=30) == {"k": 1}
    fresh = app.AsyncResult(retried.id)
    assert fresh.name == TASK + "retry_once"
    assert fresh.args == [{"k": 1}]
    assert fresh.kwargs == {}
    assert fresh.retries == 1
    assert fresh.worker.startswith("ext@")
    assert fresh.queue == "celery"
    assert fresh.date_done is not None


def test_groups_resultsets_and_get_many(app: Celery, worker: Callable[..., Worker]) -> None:
    worker()
    res = group(sig(app, "add", i, i) for i in range(10)).apply_async()
    assert res.get(timeout=30) == [2 * i for i in range(10)]
    assert res.join(timeout=30) == [2 * i for i in range(10)]
    rs = ResultSet([send(app, "add", i, 1) for i in range(5)], app=app)
    assert rs.get(timeout=30) == [1, 2, 3, 4, 5]
    assert rs.join_native(timeout=30) == [1, 2, 3, 4, 5]

    res.save()
    restored = GroupResult.restore(res.id, app=app)
    assert restored is not None and [r.id for r in restored.results] == [r.id for r in res]
    res.delete()
    assert GroupResult.restore(res.id, app=app, backend=app.backend) is None

    ids = [r.id for r in res]
    got = dict(app.backend.get_many(ids, timeout=10))
    assert {tid: meta["result"] for tid, meta in got.items()} == {
        r.id: 2 * i for i, r in enumerate(res)}


def test_chord_of_100_uses_the_native_counter(app: Celery,
                                              worker: Callable[..., Worker]) -> None:
    w = worker(concurrency=8)
    result = chord([sig(app, "add", i, i) for i in range(100)])(sig(app, "tsum"))
    assert result.get(timeout=60) == sum(2 * i for i in range(100))
    assert "chord_unlock" not in w.output()
    # Completed chord: the last part finishes its counter (just after sending the body):
    # a tombstone without its 100 parts, kept until expiry.
    layout, client = app.backend.layout, app.backend.client
    [chord_id] = client.get_children(layout.chords)
    # ~sent: made by the body's publish (B17).
    wait_until(lambda: sorted(client.get_children(layout.chord(chord_id))) == [
        "~done", "~sent", "~size"], 10)
    # A header given as a generator is counted the same way, marked lazy.
    result = chord(sig(app, "add", i, i) for i in range(100))(sig(app, "tsum"))
    assert result.get(timeout=60) == sum(2 * i for i in range(100))
    [lazy_id] = set(client.get_children(layout.chords)) - {chord_id}
    wait_until(lambda: sorted(client.get_children(layout.chord(lazy_id))) == [
        "~done", "~lazy", "~sent", "~size"], 10)


def test_a_chord_header_that_nests_groups_waits_for_every_part(
        app: Celery, worker: Callable[..., Worker]) -> None:
    """Celery's own canvas suite (test_nested_group_chain): the header's chain ends
    in a group, so the chord waits for three parts, not for the two saved header
    results. One pool process, as Celery's suite runs it: a body fired early
    joins a part that process has not run, and the worker wedges."""
    w = worker(pool="prefork", concurrency=1)
    nested = chain(sig(app, "add", 1, 0, immutable=True),
                   group(sig(app, "add", 1, 100, immutable=True),
                         chain(sig(app, "add", 1, 200, immutable=True),
                               group(sig(app, "add", 1, 1000, immutable=True),
                                     sig(app, "add", 1, 2000, immutable=True)))),
                   sig(app, "add", 1, 10, immutable=True))
    assert nested.apply_async().get(timeout=60) == 11
    # and the worker goes on: a one-task header right after it
    single = chord([sig(app, "add", 2, 5)])(sig(app, "tsum"))
    assert single.get(timeout=60) == 7
    assert "incremented too many times" not in w.output()


def test_a_chord_delivered_twice_runs_twice(
        app: Celery, worker: Callable[..., Worker]) -> None:
    """The message ahead of a chord is delivered twice (Celery's canvas suite
    republishes it from before_task_publish, as RabbitMQ may redeliver it), so
    the chord is applied twice with one id. Each apply is a run, as on Redis:
    the second counts afresh and its body runs again, with the same result."""
    from celery.signals import before_task_publish

    w = worker(concurrency=4)

    captured: list[dict[str, Any]] = []

    def capture(body: Any = None, exchange: Any = None, routing_key: Any = None,
                headers: Any = None, **kwargs: Any) -> None:
        before_task_publish.disconnect(capture)   # only the canvas's first message
        captured.append({"body": body, "exchange": exchange, "routing_key": routing_key,
                         "headers": headers})

    before_task_publish.connect(capture)
    try:
        canvas = chain(sig(app, "add", 1, 1),
                       chord([sig(app, "add", 2), sig(app, "add", 3)], sig(app, "tsum")))
        result = canvas.apply_async()
    finally:
        before_task_publish.disconnect(capture)
    assert result.get(timeout=30) == 9
    # Now the duplicate, once the first run is over (a late redelivery).
    with app.producer_pool.acquire(block=True) as producer:
        producer.publish(serializer="json", **captured[0])
    wait_until(lambda: w.output().count("proj.app.tsum[") >= 2 * 2, 30,   # received, done
               message="the chord's second run did not run its body")
    assert "incremented too many times" not in w.output()
    assert app.AsyncResult(result.id).get(timeout=10) == 9


def test_chord_header_failure_reaches_the_callback(app: Celery,
                                                   worker: Callable[..., Worker]) -> None:
    worker()
    header = [sig(app, "add", 1, 1), sig(app, "fail", "header broke"), sig(app, "add", 2, 2)]
    result = chord(header)(sig(app, "tsum"))
    # As Celery documents: the body's result fails with a ChordError naming the
    # header task that raised (get() itself follows parents, so it re-raises
    # the header's own error first).
    error = result.get(timeout=30, propagate=False)
    assert isinstance(error, ChordError)
    assert "header broke" in str(error) and "Dependency" in str(error)
    assert result.state == states.FAILURE
    with pytest.raises(ChordError, match="header broke"):
        result.get(timeout=30, follow_parents=False)
    with pytest.raises(ValueError, match="header broke"):
        result.get(timeout=30)


def test_nested_chain_group_chord(app: Celery, worker: Callable[..., Worker]) -> None:
    worker()
    # group -> [2, 4]; each header tsum -> 6; body tsum -> 12; add 100 -> 112
    workflow = chain(
        group(sig(app, "add", 1, 1), sig(app, "add", 2, 2)),
        chord([sig(app, "tsum"), sig(app, "tsum")], sig(app, "tsum")),
        sig(app, "add", 100),
    )
    assert workflow.apply_async().get(timeout=60) == 112


def test_forget(app: Celery, worker: Callable[..., Worker]) -> None:
    worker()
    result = send(app, "add", 20, 22)
    assert result.get(timeout=30) == 42
    backend: ZooKeeperBackend = app.backend
    assert backend.client.exists(backend.result_path(result.id))
    result.forget()
    assert not backend.client.exists(backend.result_path(result.id))
    assert app.AsyncResult(result.id).state == states.PENDING


def test_too_large_result_fails_the_task_and_worker_goes_on(
        app: Celery, worker: Callable[..., Worker]) -> None:
    w = worker(conf={"result_backend_transport_options": {"max_result_size": 100_000}})
    big = send(app, "huge_result", 200_000)
    with pytest.raises(ResultTooLarge) as excinfo:
        big.get(timeout=30)
    message = str(excinfo.value)
    assert big.id in message and "limit of 100,000" in message and "max_result_size" in message
    assert send(app, "add", 1, 1).get(timeout=30) == 2
    assert w.proc is not None and w.proc.poll() is None


def test_results_from_prefork_children(app: Celery, worker: Callable[..., Worker]) -> None:
    w = worker(pool="prefork", concurrency=2)
    results = [send(app, "whoami", i) for i in range(8)]
    values = [r.get(timeout=60) for r in results]
    assert [v[0] for v in values] == list(range(8))
    assert w.pid not in {v[1] for v in values}  # written by the children
    res = chord(sig(app, "add", i, 1) for i in range(10))(sig(app, "tsum"))
    assert res.get(timeout=60) == sum(range(1, 11))


def test_restart_keeps_results(app: Celery, worker: Callable[..., Worker],
                               tmp_path: Path) -> None:
    """A result stored while no client waits is there for a later get()."""
    w = worker()
    result = send(app, "add", 7, 7)
    w.wait_for("succeeded", timeout=30)
    w.stop()
    time.sleep(0.2)
    assert app.AsyncResult(result.id).get(timeout=10) == 14


def test_a_burst_right_after_start_makes_the_shard_directories_once(
        app: Celery, worker: Callable[..., Worker], zookeeper_server: Any) -> None:
    """Every pool thread of a new worker stores its first result at once, into a
    root (and an hour of the expiry index) with no shard directories yet. Each
    thread used to make all 512 of them: the second half of the burst waited
    seconds behind those creates (6-7 s with a session per thread, against
    two task lengths now). Counted in the server's transactions, not timed:
    about 15,000 then, a few hundred now."""
    pool, length = 30, 1.0
    worker(concurrency=pool)
    sys.path.insert(0, str(ROOT / "benchmarks"))   # as test_bench_workers
    try:
        from common import txnlog
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    host, port = zookeeper_server.host, zookeeper_server.port
    before = txnlog.last_zxid(host, port)
    results = [send(app, "sleep_then", i, length) for i in range(2 * pool)]
    assert [result.get(timeout=60) for result in results] == list(range(2 * pool))
    made = txnlog.last_zxid(host, port) - before
    # The 512 directories once, then per task its publish, its ack's share and
    # its result's multi (and whatever other sessions did meanwhile).
    assert made < 2000, f"{made} transactions for a burst of {2 * pool} tasks"


def test_a_chord_header_given_as_a_generator_runs_while_it_is_produced(
        app: Celery, worker: Callable[..., Worker], task_log: Path) -> None:
    """Celery publishes a generator header as it yields (celery#3021): the first
    header task runs before the generator has produced the last. The body gets
    the results in header order."""
    from .workers import executed_values

    worker(env={"CELERY_ZK_TEST_LOG": str(task_log)})
    seen_running: list[bool] = []

    def header() -> Iterator[Any]:
        for i in range(5):
            yield sig(app, "record", i)
            # Celery looks one task ahead (to know the last): the first is published
            # once the third is asked for. Wait there until the worker has run it.
            if i == 2:
                try:
                    wait_until(lambda: executed_values(task_log, "record")[0] == 1, 30)
                    seen_running.append(True)
                except AssertionError:
                    seen_running.append(False)

    result = chord(header())(sig(app, "record"))
    assert result.get(timeout=60) == [0, 1, 2, 3, 4]
    assert seen_running == [True], "the first header task ran only after the generator ended"


def test_add_to_chord_makes_the_chord_wait_for_the_added_task(
        app: Celery, worker: Callable[..., Worker]) -> None:
    """``Task.add_to_chord`` (supported by Celery's Redis backend): the body waits
    for the added task and gets its result too."""
    worker(concurrency=2)
    result = chord([sig(app, "grow_chord", 1, 7), sig(app, "add", 2, 2)])(sig(app, "record"))
    assert sorted(result.get(timeout=60)) == [1, 4, 107]
    lazy = chord(sig(app, "grow_chord", i, i) for i in range(3))(sig(app, "record"))
    assert sorted(lazy.get(timeout=60)) == [0, 1, 2, 100, 101, 102]


def test_a_frozen_chord_applied_twice_runs_its_body_twice(
        app: Celery, worker: Callable[..., Worker], task_log: Path) -> None:
    """Each apply of a chord is a run of its own, as on Redis: applying a frozen
    chord again (same group id, a retried workflow) runs its body again."""
    from .workers import executed_values

    worker(env={"CELERY_ZK_TEST_LOG": str(task_log)})
    frozen = chord([sig(app, "add", 1, 1), sig(app, "add", 2, 2)], sig(app, "record"))
    frozen.freeze()
    for run in (1, 2):
        frozen.apply_async()
        wait_until(lambda run=run: executed_values(  # type: ignore[misc]
            task_log, "record")[json.dumps([2, 4])] == run, 30,
                   message=f"run {run} of the chord did not run its body")


def test_a_dropped_copy_of_a_result_does_not_end_the_wait(
        app: Celery, worker: Callable[..., Worker]) -> None:
    """Celery before 5.7 (celery#4925): any result object of a task id, when
    collected, removed the one waiting on it, so its get() never returned. A
    group's publish drops such copies; the garbage collector picks the moment."""
    worker()
    result = send(app, "sleep_then", "waited", 0.5)
    app.backend.add_pending_result(result)
    app.backend.remove_pending_result(app.AsyncResult(result.id))   # a copy's __del__
    assert result.get(timeout=30) == "waited"


def _two_part_chord(app: Celery, body: Any) -> tuple[Any, str, list[str]]:
    """A two-part chord whose header waits where no worker looks: (result, group
    id, part ids)."""
    header = [sig(app, "add", 1, 1, queue="nowhere"), sig(app, "add", 2, 2, queue="nowhere")]
    result = chord(header)(body)
    return result, result.parent.id, [r.id for r in result.parent.results]


def _stops_first(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, why: str
                 ) -> list[str]:
    """``owner.name`` stops the worker (SystemExit) the first time it is called,
    and runs as before after that; the list says whether it stopped."""
    real = getattr(owner, name)
    stops: list[str] = []

    def stops_first(*args: Any, **kwargs: Any) -> Any:
        if not stops:
            stops.append("stopped")
            raise SystemExit(why)
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, stops_first)
    return stops


def _chord_whose_first_sender_stops(app: Celery, monkeypatch: pytest.MonkeyPatch,
                                    body_id: str) -> tuple[Any, str, list[str], Any]:
    """A two-part chord whose first attempt to send its body stops the worker
    right after the last part was counted: (result, group id, part ids, body)."""
    import celery_zk.backend.backend as backend_module

    body = sig(app, "tsum").set(task_id=body_id)
    _stops_first(monkeypatch, backend_module, "send_chord_body",
                 "the worker stops before it sends the body")
    return (*_two_part_chord(app, body), body)


def test_a_chord_body_is_sent_by_its_last_part_run_again_after_its_worker_stopped(
        app: Celery, worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker that counted a chord's last part stopped before it sent the body
    (the nemesis killed one there: the body never ran). The part's message is
    redelivered and the task runs again; its count is refused as a duplicate,
    and it must send the body then."""
    from types import SimpleNamespace

    worker()   # runs the body
    backend = app.backend
    assert isinstance(backend, ZooKeeperBackend)
    result, group_id, parts, body = _chord_whose_first_sender_stops(app, monkeypatch,
                                                                    "stalled-body")

    def part_done(index: int, value: int) -> None:   # what the worker's trace does
        request = SimpleNamespace(id=parts[index], group=group_id, group_index=index,
                                  chord=dict(body), ignore_result=False)
        backend.mark_as_done(parts[index], value, request=request)

    part_done(0, 2)
    with pytest.raises(SystemExit):
        part_done(1, 4)                    # the last part: counted, then the worker stops
    assert app.AsyncResult("stalled-body").state == states.PENDING
    # Not SUCCESS: Celery's worker_deduplicate_successful_tasks would skip it.
    assert app.AsyncResult(parts[1]).state == states.STARTED
    part_done(1, 4)                        # redelivered and run again
    assert result.get(timeout=30) == 6
    assert app.AsyncResult(parts[1]).get(timeout=10) == 4


def test_a_chord_body_sent_before_its_worker_stopped_is_not_sent_again(
        app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker that counted the last part published the body and stopped
    before it finished the counter (the nemesis killed one there: the body ran
    twice, B17). The part runs again and finds every part counted and the run
    not finished; the body's publish is refused, since it made ``~sent``."""
    from types import SimpleNamespace

    from celery_zk.backend.chord import ChordCounter

    backend = app.backend
    assert isinstance(backend, ZooKeeperBackend)
    body = sig(app, "tsum", queue="bodies-b17").set(task_id="sent-once-body")
    result, group_id, parts = _two_part_chord(app, body)
    stops = _stops_first(monkeypatch, ChordCounter, "finish",
                         "the worker stops after it sent the body")

    def part_done(index: int, value: int) -> None:   # what the worker's trace does
        request = SimpleNamespace(id=parts[index], group=group_id, group_index=index,
                                  chord=dict(body), ignore_result=False)
        backend.mark_as_done(parts[index], value, request=request)

    def bodies() -> int:
        with app.connection_for_write() as conn:
            return int(conn.default_channel.queue_declare("bodies-b17",
                                                          passive=True).message_count)

    part_done(0, 2)
    with pytest.raises(SystemExit):
        part_done(1, 4)          # counted, body published, then the worker stops
    assert bodies() == 1
    part_done(1, 4)              # redelivered and run again: the run finishes
    assert bodies() == 1         # without the marker: 2, and the body ran twice
    assert stops == ["stopped"]
    # Read, not waited on: a second AsyncResult of a pending id is never woken
    # before Celery 5.7 (celery#4925), and this part's own is pending here.
    meta = backend.get_task_meta(parts[1], cache=False)
    assert (meta["status"], meta["result"]) == (states.SUCCESS, 4)


def test_with_deduplication_the_last_part_of_a_stalled_chord_runs_again(
        app: Celery, worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same stop, with ``worker_deduplicate_successful_tasks``: Celery's own
    tracer skips a redelivered task whose result is SUCCESS without calling the
    backend, so the part stored before the stop must not read SUCCESS until the
    body is sent (the nemesis turns deduplication on; B7)."""
    worker()   # runs the body
    executed = _deduplicated_add(app)
    result, group_id, parts, body = _chord_whose_first_sender_stops(app, monkeypatch,
                                                                    "deduplicated-body")
    deliver = partial(_deliver_part, app, group_id, parts, body)
    deliver(0, redelivered=False)
    with pytest.raises(SystemExit):
        deliver(1, redelivered=False)          # counted, then the worker stops
    deliver(1, redelivered=True)               # not skipped: it runs and sends the body
    assert result.get(timeout=30) == 6
    assert app.AsyncResult(parts[1]).get(timeout=10) == 4
    deliver(1, redelivered=True)               # now SUCCESS: skipped, nothing sent again
    assert executed == [1, 2, 2]


def _deduplicated_add(app: Celery) -> list[int]:
    """``add`` with ``acks_late`` and Celery's deduplication; the first arguments it ran with."""
    app.conf.update(task_acks_late=True, worker_deduplicate_successful_tasks=True)
    executed: list[int] = []

    @app.task(name=TASK + "add", shared=False)
    def add(x: int, y: int) -> int:
        executed.append(x)
        return x + y
    return executed


def _deliver_part(app: Celery, group_id: str, parts: list[str], body: Any, index: int,
                  redelivered: bool) -> None:
    """Part ``index`` (``add(index + 1, index + 1)``) run by Celery's worker tracer."""
    from celery.app.trace import build_tracer

    add = app.tasks[TASK + "add"]
    request = {"id": parts[index], "group": group_id, "group_index": index,
               "chord": dict(body), "delivery_info": {"redelivered": redelivered},
               "task": add.name}
    build_tracer(add.name, add, app=app)(parts[index], (index + 1, index + 1), {}, request)


def test_with_deduplication_a_part_stopped_before_it_was_counted_runs_again(
        app: Celery, worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker stopped after a chord part stored its result and before it counted
    the part (the nemesis killed one there: the body never ran, B21). Celery's
    deduplication skips a redelivered task whose result is SUCCESS, so a part's
    result must not read SUCCESS before the part is counted."""
    from celery_zk.backend.chord import ChordCounter

    worker()   # runs the body
    executed = _deduplicated_add(app)
    body = sig(app, "tsum").set(task_id="uncounted-body")
    result, group_id, parts = _two_part_chord(app, body)
    _stops_first(monkeypatch, ChordCounter, "increment",
                 "the worker stops before it counts the part")
    deliver = partial(_deliver_part, app, group_id, parts, body)
    with pytest.raises(SystemExit):
        deliver(0, redelivered=False)          # stored, then the worker stops
    assert app.backend.get_task_meta(parts[0], cache=False)["status"] == states.STARTED
    deliver(0, redelivered=True)               # not skipped: it runs and is counted
    meta = app.backend.get_task_meta(parts[0], cache=False)
    assert (meta["status"], meta["result"]) == (states.SUCCESS, 2)
    deliver(1, redelivered=False)
    assert result.get(timeout=30) == 6
    assert executed == [1, 1, 2]


def test_a_part_whose_result_was_forgotten_before_it_was_counted_is_counted(
        app: Celery, worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch) -> None:
    """The multi that counts a part also writes its SUCCESS: a result deleted
    between the store and the count (``forget()``) fails that write, and the
    part is counted without it at once, rather than retried until the patience
    ends; the body, which has no value for it, fails with Celery's error."""
    from celery_zk.backend.chord import ChordCounter

    worker()   # runs the body
    executed = _deduplicated_add(app)
    body = sig(app, "tsum").set(task_id="forgotten-part-body")
    result, group_id, parts = _two_part_chord(app, body)
    real_increment, real_attempt = ChordCounter.increment, ChordCounter._inner_increment
    attempts: list[str] = []

    def forgotten_first(self: ChordCounter, part_id: str, *args: Any, **kwargs: Any) -> Any:
        if part_id == parts[0]:
            app.backend.forget(part_id)
        return real_increment(self, part_id, *args, **kwargs)

    def attempt(self: ChordCounter, *args: Any) -> Any:
        attempts.append(args[0])
        return real_attempt(self, *args)
    monkeypatch.setattr(ChordCounter, "increment", forgotten_first)
    monkeypatch.setattr(ChordCounter, "_inner_increment", attempt)
    deliver = partial(_deliver_part, app, group_id, parts, body)
    deliver(0, redelivered=False)
    assert attempts == [parts[0], parts[0]], "tried again and again (until the patience ends)"
    assert ChordCounter(app.backend.client, app.backend.layout, group_id).parts() == parts[:1]
    deliver(1, redelivered=False)
    with pytest.raises(ChordError):
        result.get(timeout=30)
    assert executed == [1, 2]
