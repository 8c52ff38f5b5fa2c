"""Faults on real ZooKeeper servers under real ``celery worker`` processes.

Each test counts the tasks it submitted against the tasks that ran (the
workers append every execution to a log) and asserts that none was lost.
Duplicates are allowed (delivery is at-least-once) but reported, with the
timings, through ``print`` and ``record_property``.
"""
from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient

from celery_zk.server import ZooKeeperServer, free_ports
from celery_zk.server.ensemble import ZooKeeperEnsemble
from celery_zk.zk.layout import Layout
from celery_zk.zk.message_names import parse_message_name
from celery_zk.zk.names import parse_consumer_name

from .queues import owned as owned_paths
from .tcpproxy import TCPProxy
from .workers import Worker, celery_cli, executed_values, read_log, wait_until

ROOT = "/faults"
LAYOUT = Layout(ROOT)


# -- helpers ----------------------------------------------------------------------
class Publisher(threading.Thread):
    """Sends ``task(value)`` for each value, spread evenly over ``duration`` seconds.

    Uses a Celery app with the default publish retry, as an application would.
    A send that raises is recorded in ``errors`` and not counted as submitted.
    """

    def __init__(self, url: str, values: list[Any], duration: float,
                 task: str = "record", args: tuple[Any, ...] = ()) -> None:
        super().__init__(name="publisher", daemon=True)
        self.url, self.values, self.duration = url, values, duration
        self.task, self.args = task, args
        self.sent: list[Any] = []
        self.errors: list[tuple[Any, str]] = []
        self.slowest = 0.0  # longest single send: how long a fault blocked publishing

    def run(self) -> None:
        app = Celery("publisher", broker=self.url, set_as_current=False)
        try:
            start = time.monotonic()
            for i, value in enumerate(self.values):
                delay = start + self.duration * i / len(self.values) - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                began = time.monotonic()
                try:
                    app.send_task(f"proj.app.{self.task}", args=(value, *self.args))
                except Exception as exc:  # counted, reported, asserted on by the test
                    self.errors.append((value, repr(exc)))
                else:
                    self.sent.append(value)
                self.slowest = max(self.slowest, time.monotonic() - began)
        finally:
            app.close()


def send_all(url: str, task: str, values: list[Any], *args: Any,
             queue: str | None = None) -> None:
    app = Celery("client", broker=url, set_as_current=False)
    try:
        for value in values:
            app.send_task(f"proj.app.{task}", args=(value, *args), queue=queue)
    finally:
        app.close()


def tally(log: Path, submitted: list[Any]) -> tuple[int, int]:
    """(lost, duplicates) of ``submitted`` according to the execution log."""
    counts = executed_values(log)
    lost = sum(1 for value in submitted if counts[value] == 0)
    duplicates = sum(counts[value] - 1 for value in submitted if counts[value] > 1)
    return lost, duplicates


def wait_all_ran(log: Path, submitted: list[Any], timeout: float) -> None:
    wanted = set(submitted)
    wait_until(lambda: wanted <= set(executed_values(log)), timeout,
               message=f"tasks lost: {len(wanted - set(executed_values(log)))} of "
                       f"{len(wanted)} never ran")


def report(record_property: Any, name: str, **figures: Any) -> None:
    for key, value in figures.items():
        record_property(key, value)
    print(f"\n[{name}] " + " ".join(f"{k}={v}" for k, v in figures.items()))


def ran_in(log: Path, pid: int) -> set[Any]:
    return {entry["value"] for entry in read_log(log) if entry["pid"] == pid}


def consumers_of(client: KazooClient, pid: int) -> set[str]:
    """Consumer ids registered by process ``pid`` (the node data names it)."""
    ids = set()
    for name in client.get_children(LAYOUT.consumers):
        try:
            data, _ = client.get(LAYOUT.consumer(name))
        except Exception:
            continue
        parsed = parse_consumer_name(name)
        if parsed and json.loads(data)["pid"] == pid:
            ids.add(parsed)
    return ids


def owned(client: KazooClient, queue: str = "celery") -> dict[str, str]:
    """{owned message path: owner consumer id}."""
    return {path: LAYOUT.split_owned_path(path)[1]
            for path in owned_paths(client, LAYOUT, queue)}


def owned_values(client: KazooClient, paths: list[str], queue: str = "celery") -> set[Any]:
    """The first task argument of each owned message still there."""
    values = set()
    for path in paths:
        message = parse_message_name(path.rpartition("/")[2])
        try:
            data, _ = client.get((message and LAYOUT.body(queue, message)) or path)
        except Exception:
            continue
        body = json.loads(base64.b64decode(json.loads(data)["body"]))
        values.add(body[0][0])
    return values


@pytest.fixture
def own_server() -> Iterator[ZooKeeperServer]:
    """A ZooKeeper server of this test's own: it may be stopped and restarted."""
    server = ZooKeeperServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def observer(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Factory: observer(hosts) -> a started KazooClient, closed after the test."""
    clients: list[KazooClient] = []

    def make(hosts: str) -> KazooClient:
        client = KazooClient(hosts=hosts, timeout=10)
        client.start(timeout=15)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.stop()
        client.close()


# -- 1. a single server stopped and restarted on its data dir ---------------------
@pytest.mark.slow
@pytest.mark.parametrize("session_timeout,downtime", [(10, 2.0), (3, 5.0), (4, 10.0)],
                         ids=["down-2s", "down-longer-than-session-timeout",
                              "down-longer-than-retry-deadline"])
def test_server_restart_mid_run_loses_nothing(
        own_server: ZooKeeperServer, start_worker: Any, task_log: Path, observer: Any,
        record_property: Any, session_timeout: float, downtime: float) -> None:
    url = f"{own_server.url}{ROOT}?session_timeout={session_timeout}"
    worker = start_worker(url, log=task_log, name="restart", concurrency=4)
    publisher = Publisher(url, list(range(300)), duration=6.0)
    publisher.start()
    wait_until(lambda: len(read_log(task_log)) >= 50, 30)
    before = consumers_of(observer(own_server.hosts), worker.pid)

    own_server.stop()
    stopped = time.monotonic()
    time.sleep(downtime)
    own_server.start()
    restarted = time.monotonic()
    done_at_restart = len(read_log(task_log))
    wait_until(lambda: len(read_log(task_log)) > done_at_restart, 60,
               message=lambda: ("the worker did not resume after the server restarted; "
                                "its output, with its threads' stacks:\n"
                                f"{worker.diagnosis()}"))
    resumed = time.monotonic() - restarted

    publisher.join(60)
    assert not publisher.is_alive(), "the publisher hung after the restart"
    wait_all_ran(task_log, publisher.sent, 60)
    lost, duplicates = tally(task_log, publisher.sent)
    after = consumers_of(observer(own_server.hosts), worker.pid)
    report(record_property, f"restart {session_timeout}s/{downtime}s",
           submitted=len(publisher.sent), publish_errors=len(publisher.errors),
           lost=lost, duplicates=duplicates,
           downtime_s=round(restarted - stopped, 2), resumed_after_s=round(resumed, 2),
           slowest_publish_s=round(publisher.slowest, 2),
           session_renewed=before != after)
    assert publisher.errors == [], publisher.errors[:5]
    assert lost == 0
    assert after, "the worker has no live consumer registration after the restart"
    assert worker.proc.poll() is None, worker.output()


def test_a_new_session_waits_for_a_restarting_server_it_has_used(
        own_server: ZooKeeperServer) -> None:
    """A first contact with a server that refuses fails at once (nothing listens);
    a process that has had a session there waits connect_timeout for it instead:
    the server is restarting, and a publish retried meanwhile should not fail."""
    from kombu import Connection

    url = f"{own_server.url}{ROOT}?connect_timeout=15&session_name=restart-wait"
    with Connection(url) as first:
        first.connect()
    own_server.stop()
    restarter = threading.Timer(3.0, own_server.start)
    restarter.start()
    try:
        started = time.monotonic()
        with Connection(url) as second:
            second.connect()   # refused for 3 s, then the server is back
            assert second.transport.handle.client.connected
        assert time.monotonic() - started >= 2.5
    finally:
        restarter.join()


# -- 2. the leader of a 3-node ensemble stopped -----------------------------------
@pytest.mark.slow
def test_ensemble_leader_stopped_mid_run_loses_nothing(
        start_worker: Any, task_log: Path, record_property: Any) -> None:
    ensemble = ZooKeeperEnsemble(3)
    ensemble.start()
    worker = None
    try:
        url = f"{ensemble.url}{ROOT}?session_timeout=10"
        worker = start_worker(url, log=task_log, name="ensemble", concurrency=4)
        publisher = Publisher(url, list(range(300)), duration=6.0)
        publisher.start()
        wait_until(lambda: len(read_log(task_log)) >= 50, 30)
        leader = ensemble.leader_index()
        ensemble.stop_member(leader)
        stopped = time.monotonic()
        done_at_stop = len(read_log(task_log))
        wait_until(lambda: len(read_log(task_log)) > done_at_stop + 10, 60,
                   message="work did not continue after the leader stopped")
        resumed = time.monotonic() - stopped
        new_leader = ensemble.wait_for_quorum(30)
        election = time.monotonic() - stopped
        publisher.join(60)
        assert not publisher.is_alive(), "the publisher hung after the leader stopped"
        ensemble.start_member(leader)  # it rejoins as a follower; work goes on
        late = list(range(1000, 1050))
        send_all(url, "record", late)
        submitted = publisher.sent + late
        wait_all_ran(task_log, submitted, 60)
        lost, duplicates = tally(task_log, submitted)
        report(record_property, "ensemble leader stop",
               submitted=len(submitted), publish_errors=len(publisher.errors),
               lost=lost, duplicates=duplicates, old_leader=leader, new_leader=new_leader,
               new_leader_after_s=round(election, 2), work_resumed_after_s=round(resumed, 2),
               slowest_publish_s=round(publisher.slowest, 2))
        assert publisher.errors == [], publisher.errors[:5]
        assert lost == 0
        assert worker.proc.poll() is None, worker.output()
    finally:
        # Before the ensemble goes: a worker cut off from it waits out its
        # session for acks and publishes, past Worker.stop's patience.
        if worker is not None:
            worker.stop()
        ensemble.close()


@pytest.mark.slow
def test_a_result_written_while_a_silent_leader_is_replaced_is_stored() -> None:
    """A leader that goes silent (SIGSTOP: a pause, or a cut link) is given up by
    its followers only after syncLimit x tickTime (10 s by default), then a new one
    is elected; sessions survive it. A result stored meanwhile, with Celery's
    defaults (no result_backend_always_retry), must land, not fail the task."""
    ensemble = ZooKeeperEnsemble(3)
    ensemble.start()
    app = Celery("failover", broker="memory://", set_as_current=False,
                 backend=f"{ensemble.url}{ROOT}-failover")
    leader_pid = None
    try:
        app.backend.store_result("before", 1, "SUCCESS")
        leader = ensemble.leader_index()
        leader_pid = ensemble.members[leader].pid
        assert leader_pid is not None
        os.kill(leader_pid, signal.SIGSTOP)
        started = time.monotonic()
        app.backend.store_result("during-failover", 42, "SUCCESS")   # raised before the fix
        took = time.monotonic() - started
        print(f"\n[silent leader] the result landed after {took:.1f}s")
        meta = app.backend.get_task_meta("during-failover")
        assert (meta["status"], meta["result"]) == ("SUCCESS", 42)
        assert ensemble.mode(leader) == "down"   # still paused: the others took over
    finally:
        if leader_pid is not None:
            os.kill(leader_pid, signal.SIGCONT)
        app.close()
        ensemble.close()


@pytest.mark.slow
@pytest.mark.parametrize("step", ["_metas", "_sent_once"], ids=["reads", "publish"])
def test_a_chord_whose_last_part_returns_while_a_silent_leader_is_replaced_sends_its_body(
        monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    """The last part of a chord counts itself, reads the header's results and
    publishes the body: writes and reads that nobody redoes (its message is
    acked either way). Before they rode out a failover as a result write does,
    one that fell into it failed the body with ChordError for good (a possible
    cause of the nemesis's B19). The leader goes silent as the part reads the
    header's results, or as it publishes the body; a follower is paused for
    12 s with it, so no quorum forms before the command retry's 10 s are
    spent (an election alone took 13-17 s here, close to that)."""
    from types import SimpleNamespace

    from celery import chord, states

    from celery_zk.backend import chord_body

    ensemble = ZooKeeperEnsemble(3)
    ensemble.start()
    url = f"{ensemble.url}{ROOT}-chord-failover"
    app = Celery("chord-failover", broker=url, backend=url, set_as_current=False)
    leader_pid = follower_pid = None
    try:
        header = [app.signature("proj.app.add", (i, i), queue="nowhere") for i in (1, 2)]
        body = app.signature("proj.app.tsum", queue="bodies").set(task_id="failover-body")
        result = chord(header)(body)
        group_id, parts = result.parent.id, [r.id for r in result.parent.results]
        backend = app.backend

        def request(index: int) -> Any:   # what the worker's tracer passes
            return SimpleNamespace(id=parts[index], group=group_id, group_index=index,
                                   chord=dict(body), ignore_result=False)

        backend.mark_as_done(parts[0], 2, request=request(0))
        leader = ensemble.leader_index()
        leader_pid = ensemble.members[leader].pid
        follower_pid = ensemble.members[(leader + 1) % 3].pid
        assert leader_pid is not None and follower_pid is not None
        real_step, paused = getattr(chord_body, step), []
        follower_back = threading.Timer(12.0, os.kill, (follower_pid, signal.SIGCONT))

        def leader_goes_silent(*args: Any) -> Any:
            if not paused:
                os.kill(follower_pid, signal.SIGSTOP)
                os.kill(leader_pid, signal.SIGSTOP)
                follower_back.start()
                paused.append(time.monotonic())
            return real_step(*args)
        monkeypatch.setattr(chord_body, step, leader_goes_silent)
        backend.mark_as_done(parts[1], 4, request=request(1))   # the last part
        assert paused, f"the last part never came to {step}"
        follower_back.join()
        took = time.monotonic() - paused[0]
        print(f"\n[silent leader] the chord's body was sent {took:.1f}s into the failover")
        assert ensemble.mode(leader) == "down"   # still paused: the others took over
        meta = backend.get_task_meta("failover-body", cache=False)
        assert meta["status"] == states.PENDING, meta   # not failed with ChordError
        with app.connection_for_write() as conn:
            waiting = conn.default_channel.queue_declare("bodies", passive=True)
        assert waiting.message_count == 1   # the body, sent once
        meta = backend.get_task_meta(parts[1], cache=False)
        assert (meta["status"], meta["result"]) == (states.SUCCESS, 4)   # restored
    finally:
        for pid in (leader_pid, follower_pid):
            if pid is not None:
                os.kill(pid, signal.SIGCONT)
        app.close()
        ensemble.close()


# -- 3 and 4. a live worker whose session expires ---------------------------------
def _expire_live_worker(make_url: Any, start_worker: Any,
                        task_log: Path, observer: Any, observer_hosts: str,
                        record_property: Any, name: str, cut: Any, restore: Any,
                        outage: float = 6.0) -> None:
    """Two workers share acks_late work; ``cut`` isolates A past its session timeout.

    B must take over A's messages; when A is back, acks for messages it held
    under the old session must be refused, it must register again, take new
    work, and in the end nothing is lost. A also runs one task that outlasts
    the outage (on a queue of its own), so its ack comes after A reconnected.
    """
    url_a, url_b = make_url("a"), make_url("b")
    a = start_worker(url_a, log=task_log, name="a", concurrency=4, queues="celery,only_a")
    b = start_worker(url_b, log=task_log, name="b", concurrency=4)
    zk = observer(observer_hosts)
    total = 120
    submitted: list[Any] = ["long-a", *range(total)]
    send_all(url_b, "slow_record", ["long-a"], outage + 3, queue="only_a")
    send_all(url_b, "slow_record", submitted[1:], 0.25)
    wait_until(lambda: len(ran_in(task_log, a.pid)) >= 4 and len(ran_in(task_log, b.pid)) >= 4,
               30, message="both workers should be running tasks")
    old_ids = consumers_of(zk, a.pid)
    assert old_ids, "worker A has no consumer registration"
    held = [n for n, owner in owned(zk).items() if owner in old_ids]
    held_values = owned_values(zk, held)
    assert held_values, "worker A holds no messages to recover"

    cut(a)
    isolated = time.monotonic()
    try:
        wait_until(lambda: not set(owned(zk).values()) & old_ids, 30,
                   message="A's messages were never requeued")
        requeued = time.monotonic() - isolated
        wait_until(lambda: ran_in(task_log, b.pid) & held_values, 30,
                   message="B never ran a message A held")
        taken_over = time.monotonic() - isolated
        time.sleep(max(0.0, outage - (time.monotonic() - isolated)))
    finally:
        restore(a)
    restored = time.monotonic()

    wait_until(lambda: consumers_of(zk, a.pid) - old_ids, 30,
               message=f"A never registered again:\n{a.output()[-3000:]}")
    reregistered = time.monotonic() - restored
    wait_all_ran(task_log, submitted, 90)

    # A takes new work under its new session.
    before_new = ran_in(task_log, a.pid)
    fresh = [f"new-{i}" for i in range(40)]
    send_all(url_b, "slow_record", fresh, 0.1)
    submitted += fresh
    wait_all_ran(task_log, submitted, 60)
    a_new = {v for v in ran_in(task_log, a.pid) - before_new if isinstance(v, str)}

    # A's pidbox binding was ephemeral and went with the old session: it must be
    # back, or `celery inspect`/`control` would never reach A again.
    ping = celery_cli(["inspect", "ping", "--timeout", "5"], url_b)
    assert "a@" in ping.stdout and "b@" in ping.stdout, ping.stdout + ping.stderr

    lost, duplicates = tally(task_log, submitted)
    refused = a.output().count("not acking")
    report(record_property, name, submitted=len(submitted), lost=lost,
           duplicates=duplicates, held_by_a=len(held_values),
           requeued_after_s=round(requeued, 2), b_ran_a_message_after_s=round(taken_over, 2),
           a_reregistered_after_s=round(reregistered, 2), acks_refused=refused,
           a_ran_new_tasks=len(a_new))
    assert lost == 0
    assert "not acking" in a.output() and "ZooKeeper session" in a.output(), \
        a.output()[-3000:]
    # Seen once in CI (stop 23), not reproduced in 15 runs: keep A's side of it.
    assert a_new, f"A took no new work after registering again:\n{a.output()[-6000:]}"
    assert "Traceback" not in a.output(), a.output()[-5000:]
    assert a.stop() == 0 and b.stop() == 0, a.output()[-3000:]  # warm shutdown still works


@pytest.mark.slow
def test_sigstopped_worker_loses_session_and_recovers(
        zookeeper_server: Any, zk_chroot: str, start_worker: Any,
        task_log: Path, observer: Any, record_property: Any) -> None:
    url = f"{zookeeper_server.url}{zk_chroot}{ROOT}?session_timeout=2"
    _expire_live_worker(
        lambda _: url, start_worker, task_log, observer,
        f"{zookeeper_server.hosts}{zk_chroot}", record_property, "SIGSTOP 6s",
        cut=lambda w: os.kill(w.pid, signal.SIGSTOP),
        restore=lambda w: os.kill(w.pid, signal.SIGCONT))


@pytest.mark.slow
def test_partitioned_worker_loses_session_and_recovers(
        zookeeper_server: Any, zk_chroot: str, start_worker: Any,
        task_log: Path, observer: Any, record_property: Any) -> None:
    host, port = zookeeper_server.hosts.rsplit(":", 1)
    with TCPProxy(host, int(port)) as proxy:
        def make_url(who: str) -> str:
            hosts = proxy.hosts if who == "a" else zookeeper_server.hosts
            return f"zk://{hosts}{zk_chroot}{ROOT}?session_timeout=2"

        _expire_live_worker(
            make_url, start_worker, task_log, observer,
            f"{zookeeper_server.hosts}{zk_chroot}", record_property, "partition 6s",
            cut=lambda w: proxy.blackhole(), restore=lambda w: proxy.heal())


# -- 5. an unreachable server -----------------------------------------------------
def test_worker_against_unreachable_server_says_so(tmp_path: Path,
                                                   record_property: Any) -> None:
    (port,) = free_ports(1)
    url = f"zk://127.0.0.1:{port}/x?connect_timeout=2"
    worker = Worker(url, tmp_dir=tmp_path, name="unreachable")
    started = time.monotonic()
    worker.start(wait_ready=False)
    try:
        # Nothing listens: said at once (a server that never answers waits
        # connect_timeout: test_transport_kombu), and Celery retries.
        expected = f"Could not connect to ZooKeeper at 127.0.0.1:{port}: connection refused"
        wait_until(lambda: expected in worker.output(), 15,
                   message=f"no clear error within 15s:\n{worker.output()}")
        report(record_property, "unreachable worker",
               error_after_s=round(time.monotonic() - started, 2))
        output = worker.output()
        assert "ready." not in output
        assert "Traceback" not in output, output
        assert worker.proc is not None and worker.proc.poll() is None  # retrying, as celery does
    finally:
        worker.stop(timeout=10)


def _unreachable_backend() -> tuple[Celery, str]:
    (port,) = free_ports(1)
    url = f"zk://127.0.0.1:{port}/x?connect_timeout=2"
    app = Celery("unreachable", broker="memory://", backend=url, set_as_current=False)
    return app, f"Could not connect to ZooKeeper at 127.0.0.1:{port}: connection refused"


def test_result_backend_against_unreachable_server_fails_clearly() -> None:
    app, expected = _unreachable_backend()
    try:
        started = time.monotonic()
        with pytest.raises(Exception, match=expected):
            app.backend.get_task_meta("some-task-id")
        assert time.monotonic() - started < 8
    finally:
        app.close()


def test_async_result_get_against_unreachable_server_fails_clearly() -> None:
    app, expected = _unreachable_backend()
    try:
        started = time.monotonic()
        with pytest.raises(Exception, match=expected):
            app.AsyncResult("some-task-id").get(timeout=6)
        assert time.monotonic() - started < 6
    finally:
        app.close()


# -- the result backend across an outage longer than kazoo's own retry --------------
@pytest.mark.slow
@pytest.mark.parametrize("always_retry", [True, False], ids=["always-retry", "no-retry"])
def test_result_backend_always_retry_rides_out_an_outage(
        own_server: ZooKeeperServer, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch, always_retry: bool) -> None:
    """With ``result_backend_always_retry`` a result stored during an outage lands
    once the server is back; without it the store fails (and says why)."""
    # An outage longer than the backend's own patience (a failover's worth, see
    # test_a_result_written_while_a_silent_leader_is_replaced_is_stored), kept short.
    monkeypatch.setattr("celery_zk.backend.writes.FAILOVER_PATIENCE", 0.0)
    app = Celery("retrying", broker="memory://", set_as_current=False,
                 backend=f"{own_server.url}/retry?session_timeout=4&connect_timeout=2")
    app.conf.update(result_backend_always_retry=always_retry, result_backend_max_retries=30,
                    result_backend_base_sleep_between_retries_ms=200,
                    result_backend_max_sleep_between_retries_ms=1000)
    outcome: dict[str, Any] = {}

    def store() -> None:
        try:
            app.backend.store_result("during-outage", 42, "SUCCESS")
            outcome["stored"] = True
        except Exception as exc:
            outcome["error"] = exc

    try:
        app.backend.store_result("before-outage", 1, "SUCCESS")
        own_server.stop()
        writer = threading.Thread(target=store, daemon=True)
        writer.start()
        time.sleep(8.0)  # longer than kazoo's command retry (max(session_timeout, 5s))
        own_server.start()
        writer.join(60)
        assert not writer.is_alive(), "store_result hung after the server came back"
        retried = [r for r in caplog.records if r.getMessage().startswith("Failed operation")]
        if always_retry:
            assert outcome == {"stored": True}, outcome
            assert retried, "the store never needed Celery's retry: the outage was too short"
            meta = app.backend.get_task_meta("during-outage")
            assert (meta["status"], meta["result"]) == ("SUCCESS", 42)
        else:
            assert "error" in outcome, outcome
            assert app.backend.exception_safe_to_retry(outcome["error"]), outcome["error"]
            assert not retried
    finally:
        app.close()


# -- found by the nemesis (benchmarks/nemesis, docs/nemesis.md) ---------------------
@pytest.mark.slow
def test_a_worker_restarted_under_its_name_hears_broadcasts_after_the_old_session_ends(
        zookeeper_server: Any, zk_chroot: str, start_worker: Any, task_log: Path) -> None:
    """Killed and restarted at once, the worker binds its pidbox queue while the
    dead process's ephemeral binding (same name) still exists; it must make its
    own once that one goes with the old session, or it hears no revoke and no
    `celery inspect` again."""
    url = f"{zookeeper_server.url}{zk_chroot}{ROOT}?session_timeout=4&handoff=false"
    first = start_worker(url, log=task_log, name="same", concurrency=1)
    first.kill()
    start_worker(url, log=task_log, name="same", concurrency=1)   # the same node name
    time.sleep(4 + 6)   # the old session expires (4 s), and its binding with it
    ping = celery_cli(["inspect", "ping", "--timeout", "5"], url)
    assert "same@" in ping.stdout, ping.stdout + ping.stderr


@pytest.mark.slow
def test_a_revoke_sent_while_a_restarted_workers_binding_was_gone_is_honoured(
        zookeeper_server: Any, zk_chroot: str, start_worker: Any, task_log: Path,
        observer: Any) -> None:
    """The restarted worker above makes its binding again once the old session
    ends; cut off at that moment, it cannot until it is back, and broadcasts
    sent meanwhile reach nobody. The revokes among them are kept in ZooKeeper
    and must be read again when the binding is made (the nemesis saw a worker
    run 7 revoked tasks so). Its own session lives through the cut (20 s)."""
    host, port = zookeeper_server.hosts.rsplit(":", 1)
    query = "handoff=false&session_timeout"
    direct = f"{zookeeper_server.url}{zk_chroot}{ROOT}?{query}=10"
    layout = Layout(ROOT)
    bindings = layout.bindings("celery.pidbox")
    zk = observer(f"{zookeeper_server.hosts}{zk_chroot}")

    def binding() -> Any:
        names = [n for n in zk.get_children(bindings) if n.startswith("same@")]
        return zk.exists(f"{bindings}/{names[0]}") if names else None

    with TCPProxy(host, int(port)) as proxy:
        first = start_worker(direct, log=task_log, name="same", concurrency=1)
        old_owner = binding().ephemeralOwner
        first.kill()
        second = start_worker(f"zk://{proxy.hosts}{zk_chroot}{ROOT}?{query}=20",
                              log=task_log, name="same", concurrency=1)  # binds to the old node
        proxy.blackhole()
        wait_until(lambda: binding() is None, 30, message="the old session's binding stayed")
        app = Celery("revoker", broker=direct, set_as_current=False)
        try:
            doomed = "revoked-while-cut-off"
            doomed_id = f"{doomed}-{zk_chroot[-8:]}"
            app.control.revoke(doomed_id)   # broadcast to nobody; kept in ZooKeeper
            proxy.heal()
            wait_until(lambda: binding() is not None, 30, message="never bound again")
            assert binding().ephemeralOwner != old_owner
            time.sleep(1)
            app.send_task("proj.app.record", args=(doomed,), task_id=doomed_id)
        finally:
            app.close()
        send_all(direct, "record", ["after"])
        wait_all_ran(task_log, ["after"], 30)
        time.sleep(1)
        second.stop()   # while its proxy still stands: cut off, it would wait out its session
    assert doomed not in executed_values(task_log)


def _cut_a_past_its_session(url_a: str, url_b: str, zk: Any, start_worker: Any,
                            task_log: Path, pool: str, settle: float, back: float,
                            cut: Any, restore: Any,
                            seconds: float = 3) -> tuple[list[Any], Any]:
    """Worker A (``pool``, -c 1) holds acks_late tasks of ``seconds``; ``cut`` off
    ``settle`` s after it holds 4, past its 2 s session; B runs everything; A is
    ``restore``d and given ``back`` s to run again what it would. The values run
    twice, and A."""
    a = start_worker(url_a, log=task_log, name="a", pool=pool, concurrency=1)
    values = list(range(6))
    send_all(url_b, "slow_record", values, seconds)   # acks_late
    wait_until(lambda: len(owned(zk)) >= 4, 30, message="A holds too little")
    time.sleep(settle)
    cut(a)
    try:
        b = start_worker(url_b, log=task_log, name="b", pool=pool, concurrency=4)
        wait_until(lambda: set(values) <= set(executed_values(task_log)), 60,
                   message="B did not run what A held")
        assert b.proc is not None
    finally:
        restore(a)
    time.sleep(back)   # A is back; whatever it would run again, it runs now
    counts = executed_values(task_log)
    return [v for v in values if counts[v] > 1], a


def _pause_a_past_its_session(zookeeper_server: Any, zk_chroot: str, start_worker: Any,
                              task_log: Path, observer: Any, pool: str, settle: float,
                              back: float) -> tuple[list[Any], Any]:
    """:func:`_cut_a_past_its_session` by SIGSTOP and SIGCONT."""
    url = f"{zookeeper_server.url}{zk_chroot}{ROOT}?session_timeout=2"
    return _cut_a_past_its_session(
        url, url, observer(f"{zookeeper_server.hosts}{zk_chroot}"), start_worker, task_log,
        pool, settle, back, cut=lambda w: os.kill(w.pid, signal.SIGSTOP),
        restore=lambda w: os.kill(w.pid, signal.SIGCONT))


@pytest.mark.slow
def test_after_its_session_expired_a_prefork_worker_drops_what_it_held_unstarted(
        zookeeper_server: Any, zk_chroot: str, start_worker: Any, task_log: Path,
        observer: Any) -> None:
    """A paused past its session timeout: B runs everything A held. When A comes
    back its transport says the connection was lost, and Celery drops the
    messages it had prefetched and not started (prefork reserves them outside
    the pool) instead of running them a second time."""
    twice, a = _pause_a_past_its_session(zookeeper_server, zk_chroot, start_worker,
                                         task_log, observer, "prefork", settle=0.0, back=8)
    # The one A was running when paused may run twice (at-least-once), and one
    # more: the pool may take the next before A's consumer sees the expiry
    # (the pool's pipe and the transport's wake-up are read in either order).
    # Without the transport saying so, A ran all it held again (4 or 5 here).
    assert len(twice) <= 2, (twice, a.output()[-3000:])


@pytest.mark.slow
def test_after_its_session_expired_a_thread_worker_drops_what_its_pool_had_not_started(
        zookeeper_server: Any, zk_chroot: str, start_worker: Any, task_log: Path,
        observer: Any) -> None:
    """The thread pool's variant of the test above: Celery hands every task it
    receives to the pool at once, where all but the running one wait. When A's
    session has expired and Celery resets the connection, those must be dropped
    (prefork's flush does that; the thread pool's did nothing), not run after B
    ran them, nor after a revoke A learnt on reconnecting (the nemesis found it)."""
    # settle: Celery has received what A holds: one runs, the rest wait in the pool.
    twice, a = _pause_a_past_its_session(zookeeper_server, zk_chroot, start_worker,
                                         task_log, observer, "threads", settle=0.5, back=10)
    # The one A was running when paused runs twice (at-least-once), and no more.
    # Its sleep ended during the pause, so it returns at once, and a pool thread
    # starts the next in the milliseconds before kazoo hears that the session
    # expired: the start gate's round trip after a pause stops that one (without
    # it 2 ran twice). Without the flush every one waiting in its pool ran again
    # (4 here).
    assert len(twice) <= 1, (twice, a.output()[-3000:])
    # Those waiting are dropped by the flush or, when a pool thread gets to them
    # first, refused by the gate.
    assert ("the thread pool had not started are dropped" in a.output()
            or "not started: it was delivered under" in a.output()), a.output()[-3000:]
    assert "this process was stopped for" in a.output(), a.output()[-3000:]


@pytest.mark.slow
def test_a_thread_worker_cut_off_starts_nothing_until_it_knows_its_session_lives(
        zookeeper_server: Any, zk_chroot: str, start_worker: Any, task_log: Path,
        observer: Any) -> None:
    """A cut off from ZooKeeper (its client SUSPENDED) cannot know whether its
    session lives; past the session timeout the ensemble gives its messages to
    B. A task a pool thread takes up meanwhile must wait for the answer, not
    start (the nemesis saw a revoked task start so): here A's running task ends
    3.5 s into the cut, after the client noticed, and the next waits."""
    host, port = zookeeper_server.hosts.rsplit(":", 1)
    url = f"{zookeeper_server.url}{zk_chroot}{ROOT}?session_timeout=2"
    with TCPProxy(host, int(port)) as proxy:
        twice, a = _cut_a_past_its_session(
            f"zk://{proxy.hosts}{zk_chroot}{ROOT}?session_timeout=2", url,
            observer(f"{zookeeper_server.hosts}{zk_chroot}"), start_worker, task_log,
            "threads", settle=1.5, back=8, cut=lambda w: proxy.blackhole(),
            restore=lambda w: proxy.heal(), seconds=5)
        a.stop()   # while its proxy still stands: cut off, it would wait out its session
    # Only the one running when cut off runs twice. Without the gate the pool
    # started the next while cut off (2 ran twice).
    assert len(twice) <= 1, (twice, a.output()[-3000:])
    assert "not started: it was delivered under" in a.output(), a.output()[-3000:]


@pytest.mark.slow
def test_a_revoke_made_while_a_worker_was_away_is_honoured_when_it_is_back(
        zookeeper_server: Any, zk_chroot: str, start_worker: Any, task_log: Path) -> None:
    """A's session expires while it is paused; its pidbox queue is swept, so the
    broadcast revoke never reaches it. Back, it must read the revokes kept in
    ZooKeeper again (not only at its first consume), or it runs a revoked task."""
    url = f"{zookeeper_server.url}{zk_chroot}{ROOT}?session_timeout=2"
    start_worker(url, log=task_log, name="b", queues="other")   # the recovery leader
    a = start_worker(url, log=task_log, name="a", concurrency=1)
    os.kill(a.pid, signal.SIGSTOP)
    try:
        time.sleep(2 + 4)   # its session expires; B sweeps its pidbox queue
        app = Celery("revoker", broker=url, set_as_current=False)
        try:
            doomed = app.send_task("proj.app.record", args=("revoked-while-away",))
            app.control.revoke(doomed.id)
        finally:
            app.close()
    finally:
        os.kill(a.pid, signal.SIGCONT)
    send_all(url, "record", ["after"])
    wait_all_ran(task_log, ["after"], 30)
    time.sleep(1)
    assert "revoked-while-away" not in executed_values(task_log), a.output()[-3000:]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_a_prefork_child_does_not_start_a_task_revoked_while_it_was_paused(
        zk_url: str, start_worker: Any, task_log: Path) -> None:
    """B12: a prefork parent checks its revoked set when it hands a task to a
    child; a child has no revoked set of its own. Here the child is stopped
    when ``doomed`` is handed to it, then the parent is stopped too and the
    revoke is sent, which the parent cannot hear; the child is resumed first.
    It must read the kept revoke before it starts the task (the nemesis saw a
    prefork child run a task 17 s after its revoke)."""
    url = f"{zk_url}?session_timeout=10"
    a = start_worker(url, backend=url, log=task_log, name="a", pool="prefork",
                     concurrency=1)
    send_all(url, "record", ["warm"])   # the child has run a task before
    wait_all_ran(task_log, ["warm"], 30)
    [child] = _children(a.pid)
    app = Celery("revoker", broker=url, backend=url, set_as_current=False)
    try:
        os.kill(child, signal.SIGSTOP)
        try:
            doomed = app.send_task("proj.app.record", args=("doomed",))
            wait_until(lambda: "proj.app.record[" + doomed.id in a.output(), 30,
                       message=a.output()[-3000:])
            time.sleep(0.5)   # handed to the (stopped) child
            os.kill(a.pid, signal.SIGSTOP)
            try:
                app.control.revoke(doomed.id)   # kept; the parent hears it when resumed
                time.sleep(1.5)
            finally:
                os.kill(child, signal.SIGCONT)
            time.sleep(2)     # the child alone runs
        finally:
            os.kill(child, signal.SIGCONT)
            os.kill(a.pid, signal.SIGCONT)
        wait_until(lambda: doomed.state == "REVOKED", 60,
                   message=f"state {doomed.state}:\n{a.output()[-3000:]}")
        send_all(url, "record", ["after"])
        wait_all_ran(task_log, ["after"], 30)
    finally:
        app.close()
    assert "doomed" not in executed_values(task_log), a.output()[-3000:]
    assert "it was revoked while this worker was cut off or paused" in a.output(), \
        a.output()[-3000:]


def test_a_write_whose_retry_gave_up_as_the_client_reconnected_is_tried_once_more(
        zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """kazoo's command retry gave up (its tries spent while the connection was
    down) just as the client reconnected: a result write must not fail then
    (the nemesis saw a task's result stored as FAILURE 25 ms after a
    reconnect, its patience spent)."""
    from kazoo.retry import RetryFailedError

    from celery_zk.zk.client import connected_retry

    real_retry = zk_client.retry
    calls: list[str] = []

    def retry(func: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(zk_client.state)
        if len(calls) == 1:
            raise RetryFailedError("Too many retry attempts")
        return real_retry(func, *args, **kwargs)

    monkeypatch.setattr(zk_client, "retry", retry)
    connected_retry(zk_client, zk_client.create, "/once-more", b"x", patience=0.0)
    assert zk_client.get("/once-more")[0] == b"x" and calls == ["CONNECTED"] * 2


@pytest.mark.slow
@pytest.mark.parametrize("pool,outage", [("threads", "cut-off"), ("prefork", "server-stopped")])
def test_a_worker_cut_off_from_zookeeper_finishes_its_warm_shutdown(
        own_server: ZooKeeperServer, start_worker: Any, task_log: Path, pool: str,
        outage: str) -> None:
    """An operator stops a worker during an outage (a deploy, a drained node).
    kazoo holds a request made while it reconnects until it is connected
    again, and the shutdown's tidying (offers withdrawn, its inbox given back)
    is such requests: the worker never exited. It now gives its session up
    (SHUTDOWN_GRACE after the shutdown began cut off) and exits; what it held
    runs elsewhere once ZooKeeper ends the session."""
    host, port = own_server.hosts.rsplit(":", 1)
    values = list(range(6))
    with TCPProxy(host, int(port)) as proxy:
        via = proxy.hosts if outage == "cut-off" else own_server.hosts
        url = f"zk://{via}{ROOT}?session_timeout=4"
        direct = f"zk://{own_server.hosts}{ROOT}?session_timeout=4"
        a = start_worker(url, log=task_log, name="a", pool=pool, concurrency=1)
        send_all(direct, "slow_record", values, 1.0)   # acks_late
        wait_until(lambda: len(read_log(task_log)) >= 1, 30, message="A ran nothing")
        if outage == "cut-off":
            proxy.blackhole()
        else:
            own_server.stop()
        code = a.stop(timeout=45)
        output = a.output()
        assert code is not None and code >= 0, f"SIGKILLed after 45 s:\n{output[-3000:]}"
        assert "giving the session up" in output, output[-3000:]
        if outage == "cut-off":
            proxy.heal()
        else:
            own_server.start()
        start_worker(direct, log=task_log, name="b", pool=pool, concurrency=4)
        wait_all_ran(task_log, values, 60)


@pytest.mark.slow
def test_a_thread_worker_stopped_while_cut_off_stores_the_result_of_its_running_task(
        own_server: ZooKeeperServer, start_worker: Any, task_log: Path) -> None:
    """A threads worker stores its tasks' results through its own session: it
    is not given up while a task runs. Cut off 1 s into a 10 s task, stopped,
    and back 6.5 s later, before the task ends: the result lands. (Given up
    2 s after the client noticed the cut, the write failed at once.)"""
    host, port = own_server.hosts.rsplit(":", 1)
    direct = f"zk://{own_server.hosts}{ROOT}?session_timeout=4"
    with TCPProxy(host, int(port)) as proxy:
        url = f"zk://{proxy.hosts}{ROOT}?session_timeout=4"
        a = start_worker(url, backend=url, log=task_log, name="a", pool="threads",
                         concurrency=1)
        client = Celery("client", broker=direct, backend=direct, set_as_current=False)
        try:
            result = client.send_task("proj.app.slow_record", args=("long", 10))
            a.wait_for(f"Task proj.app.slow_record[{result.id}] received", 30)
            time.sleep(1.0)
            proxy.blackhole()
            time.sleep(0.5)
            os.kill(a.pid, signal.SIGTERM)
            time.sleep(6.0)
            proxy.heal()
            assert result.get(timeout=60) == "long", a.output()[-3000:]
            code = a.stop(timeout=45)
            assert code is not None and code >= 0, a.output()[-3000:]
        finally:
            client.close()
