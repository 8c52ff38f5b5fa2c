"""Worker behaviours Celery users rely on, each against real ``celery worker``
processes (threads and prefork where the behaviour exists for both) on zk://:
shutdowns, consumers added and cancelled, queue selection, broadcast and
direct queues, pool sizes, and what a failed or lost task does to its message."""
from __future__ import annotations

import signal
import socket
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import celery
import pytest
from celery import Celery
from kazoo.client import KazooClient

from celery_zk.zk.layout import Layout

from .queues import owned, unowned_creations, waiting
from .workers import executed_values, read_log, wait_until

LAYOUT = Layout("/")  # the zk_client fixture is chrooted at the test's root
POOLS = ["threads", "prefork"]
SOFT_SHUTDOWN = pytest.mark.skipif(celery.VERSION < (5, 5),
                                   reason="soft shutdown is Celery 5.5's")


@pytest.fixture
def client_app(zk_url: str) -> Iterator[Celery]:
    app = Celery("client", broker=zk_url, backend=zk_url, set_as_current=False)
    yield app
    app.close()


def send(app: Celery, name: str, *args: Any, **options: Any) -> Any:
    return app.send_task(f"proj.app.{name}", args=args, **options)


def _ended(task_log: Path) -> list[Any]:
    return [e["value"]["value"] for e in read_log(task_log) if e["kind"] == "timed"]


def _started(task_log: Path) -> list[Any]:
    return [e["value"]["value"] for e in read_log(task_log) if e["kind"] == "timed-start"]


def test_a_redis_users_transport_options_start_a_worker(
        client_app: Celery, worker, task_log: Path) -> None:
    """Options that mean nothing for ZooKeeper are named once each, with why,
    and ignored: the worker starts and works."""
    options = {"visibility_timeout": 43200, "priority_steps": [0, 3, 6, 9], "sep": ":",
               "queue_order_strategy": "priority", "socket_timeout": 5}
    client_app.conf.broker_transport_options = options
    w = worker(log=task_log, conf={"broker_transport_options": options})
    send(client_app, "record", "redis-user")
    wait_until(lambda: "redis-user" in executed_values(task_log), 30)
    for name in options:
        assert f"option '{name}' is ignored" in w.output(), w.output()[-3000:]


@pytest.mark.parametrize("pool", POOLS)
def test_add_consumer_and_cancel_consumer(client_app: Celery, worker, task_log: Path,
                                          zk_client: KazooClient, pool: str) -> None:
    worker(log=task_log, pool=pool, queues="celery")
    send(client_app, "record", "before", queue="extra")
    time.sleep(1)
    assert "before" not in executed_values(task_log)   # nobody consumes "extra" yet
    replies = client_app.control.add_consumer("extra", reply=True, limit=1, timeout=10)
    assert replies and "ok" in str(replies), replies
    wait_until(lambda: "before" in executed_values(task_log), 30)
    replies = client_app.control.cancel_consumer("extra", reply=True, limit=1, timeout=10)
    assert replies and "ok" in str(replies), replies
    send(client_app, "record", "after", queue="extra")
    send(client_app, "record", "default")
    wait_until(lambda: "default" in executed_values(task_log), 30)
    time.sleep(1)
    assert "after" not in executed_values(task_log)
    assert len(waiting(zk_client, LAYOUT, "extra")) == 1   # it waits for a consumer
    assert owned(zk_client, LAYOUT, "extra") == []   # nothing held by the cancelled one


def test_exclude_queues(client_app: Celery, worker, task_log: Path,
                        zk_client: KazooClient) -> None:
    """``-X``: the worker consumes every configured queue but those."""
    queues = {"celery": {}, "a": {}, "b": {}}
    client_app.conf.task_queues = None
    worker(log=task_log, extra_args=["--exclude-queues=b"], conf={"task_queues": queues})
    for queue in ("celery", "a", "b"):
        send(client_app, "record", queue, queue=queue)
    wait_until(lambda: {"celery", "a"} <= set(executed_values(task_log)), 30)
    time.sleep(1)
    assert "b" not in executed_values(task_log)
    assert len(waiting(zk_client, LAYOUT, "b")) == 1


def test_a_broadcast_queue_reaches_every_worker(client_app: Celery, worker, task_log: Path,
                                                zk_client: KazooClient) -> None:
    env = {"CELERY_ZK_TEST_BROADCAST": "everyone"}
    worker(log=task_log, name="one", env=env)
    worker(log=task_log, name="two", pool="prefork", concurrency=2, env=env)
    # To the fanout exchange the workers declared (its type is kept in ZooKeeper).
    send(client_app, "where_run", "hello", exchange="everyone", routing_key="everyone")
    wait_until(lambda: len([e for e in read_log(task_log) if e["kind"] == "where"]) >= 2, 30)
    time.sleep(1)
    hosts = sorted(e["value"][1].split("@")[0] for e in read_log(task_log)
                   if e["kind"] == "where")
    assert hosts == ["one", "two"]   # one copy each, no more


def test_worker_direct_reaches_that_worker_only(client_app: Celery, worker,
                                                task_log: Path) -> None:
    from celery.utils.nodenames import worker_direct

    conf = {"worker_direct": True}
    worker(log=task_log, name="one", conf=conf)
    worker(log=task_log, name="two", conf=conf)
    target = f"two@{socket.gethostname()}"
    for index in range(6):
        send(client_app, "where_run", index, queue=worker_direct(target))
    wait_until(lambda: len([e for e in read_log(task_log) if e["kind"] == "where"]) >= 6, 30)
    assert {e["value"][1] for e in read_log(task_log) if e["kind"] == "where"} == {target}


def _pool_size(app: Celery, name: str) -> int:
    stats = app.control.inspect(destination=[name], timeout=10).stats() or {}
    return len(stats[name]["pool"]["processes"])


def test_pool_grow_and_pool_shrink(client_app: Celery, worker, task_log: Path) -> None:
    """Prefork only: Celery's thread pool cannot grow."""
    worker(log=task_log, pool="prefork", concurrency=1, name="sized")
    name = f"sized@{socket.gethostname()}"
    assert _pool_size(client_app, name) == 1
    assert "ok" in str(client_app.control.pool_grow(1, destination=[name], reply=True))
    wait_until(lambda: _pool_size(client_app, name) == 2, 30)
    assert "ok" in str(client_app.control.pool_shrink(1, destination=[name], reply=True))
    wait_until(lambda: _pool_size(client_app, name) == 1, 30)
    send(client_app, "record", "sized")
    wait_until(lambda: "sized" in executed_values(task_log), 30)


def test_autoscale_grows_to_a_backlog(client_app: Celery, worker, task_log: Path) -> None:
    """Prefork only: Celery's thread pool has no autoscaler. A backlog grows
    the pool to the autoscale maximum (its prefetch follows the maximum)."""
    w = worker(log=task_log, pool="prefork", name="scaled", extra_args=["--autoscale=4,1"])
    name = f"scaled@{socket.gethostname()}"
    assert _pool_size(client_app, name) == 1
    for index in range(8):
        send(client_app, "timed", index, 1.5)
    wait_until(lambda: _pool_size(client_app, name) == 4, 30, message=lambda: w.output())
    wait_until(lambda: sorted(_ended(task_log)) == list(range(8)), 60)
    assert max(Counter(_ended(task_log)).values()) == 1


def test_reject_on_worker_lost_runs_the_task_again(client_app: Celery, worker, task_log: Path,
                                                   zk_client: KazooClient,
                                                   tmp_path: Path) -> None:
    """A prefork child killed under a task with ``acks_late`` and
    ``reject_on_worker_lost``: its message goes back and runs again (the
    worker's own reject, no session lost)."""
    worker(log=task_log, pool="prefork", concurrency=2)
    send(client_app, "die_once", "phoenix", str(tmp_path / "died"))
    wait_until(lambda: "phoenix" in executed_values(task_log), 60)
    assert (tmp_path / "died").exists()
    assert executed_values(task_log)["phoenix"] == 1
    wait_until(lambda: owned(zk_client, LAYOUT, "celery") == [], 10)
    assert waiting(zk_client, LAYOUT, "celery") == []


@pytest.mark.parametrize("pool", ["threads", pytest.param("prefork", marks=pytest.mark.matrix)])
def test_acks_on_failure_or_timeout_false_rejects_a_failed_task(
        client_app: Celery, worker, zk_client: KazooClient, pool: str) -> None:
    """``task_acks_on_failure_or_timeout=False`` with late acks: Celery rejects
    the failed task's message without requeue; it goes to dead/ (with
    dead_letter_rejected), and never runs again."""
    conf = {"task_acks_late": True, "task_acks_on_failure_or_timeout": False,
            "broker_transport_options": {"dead_letter_rejected": True}}
    worker(pool=pool, conf=conf)
    result = send(client_app, "fail", "on purpose")
    with pytest.raises(ValueError, match="on purpose"):
        result.get(timeout=30)
    wait_until(lambda: len(zk_client.get_children(LAYOUT.dead("celery"))) == 1, 10)
    assert owned(zk_client, LAYOUT, "celery") == [] and waiting(zk_client, LAYOUT,
                                                                "celery") == []


@SOFT_SHUTDOWN
@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("soft", [2.0, 0.0])
def test_soft_and_cold_shutdown_lose_nothing(client_app: Celery, worker, task_log: Path,
                                             zk_client: KazooClient, pool: str,
                                             soft: float) -> None:
    """SIGQUIT (cold shutdown), with ``worker_soft_shutdown_timeout`` (soft):
    tasks that end within it are acknowledged and never run again; the long
    ones do not end there; what the stopped worker held unacknowledged goes
    back, and the next worker runs it (nothing stays owned). Celery's thread
    pool cannot cancel a running task (no ``kill_job``: its cold shutdown
    ends in "Unrecoverable error"), so there the process exits with them, and
    its session's end gives them back."""
    conf = {"worker_soft_shutdown_timeout": soft}
    for index in range(2):
        send(client_app, "timed", f"short-{index}", 0.5)
    for index in range(2):
        send(client_app, "timed", f"long-{index}", 5.0)
    for index in range(6):
        send(client_app, "timed", f"queued-{index}", 0.1)
    first = worker(log=task_log, pool=pool, concurrency=4, name="first", conf=conf)
    wait_until(lambda: len(_started(task_log)) >= 4, 30)
    assert {"long-0", "long-1"} <= set(_started(task_log))
    assert first.stop(signal.SIGQUIT, timeout=60) is not None
    ended = _ended(task_log)
    if soft:
        assert {"short-0", "short-1"} <= set(ended), first.output()[-3000:]
        assert "Initiating Soft Shutdown" in first.output()
    if pool == "prefork":   # cancelled; a thread pool's shutdown waits for its threads
        assert not [v for v in ended if v.startswith("long")]
    worker(log=task_log, pool=pool, concurrency=4, name="second")
    wait_until(lambda: len(set(_ended(task_log))) == 10, 60)
    wait_until(lambda: owned(zk_client, LAYOUT, "celery") == [], 15)
    counts = Counter(_ended(task_log))
    for value in ended:   # acknowledged by the first worker: not run again
        assert counts[value] == 1, value


@SOFT_SHUTDOWN
def test_soft_shutdown_on_idle_gives_back_held_countdown_tasks(
        client_app: Celery, worker, task_log: Path, zk_client: KazooClient) -> None:
    """``worker_enable_soft_shutdown_on_idle``: an idle worker holding
    countdown tasks stops on SIGQUIT; the tasks go back and run once, when due."""
    conf = {"worker_soft_shutdown_timeout": 1.0, "worker_enable_soft_shutdown_on_idle": True}
    first = worker(log=task_log, concurrency=2, name="first", conf=conf)
    # A naive eta goes to a worker at once, which holds it (an aware one, such
    # as countdown's, would wait in ZooKeeper: test_delayed.py).
    eta = datetime.now(timezone.utc).replace(tzinfo=None) + timedelta(seconds=6)
    for index in range(3):
        send(client_app, "timed", f"eta-{index}", 0.0, eta=eta)
    wait_until(lambda: len(owned(zk_client, LAYOUT, "celery")) == 3, 15)   # held
    first.stop(signal.SIGQUIT, timeout=30)
    assert "Initiating Soft Shutdown" in first.output()
    wait_until(lambda: owned(zk_client, LAYOUT, "celery") == [], 15)
    worker(log=task_log, concurrency=2, name="second")
    wait_until(lambda: sorted(_ended(task_log)) == ["eta-0", "eta-1", "eta-2"], 60)
    time.sleep(1)
    assert max(Counter(_ended(task_log)).values()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("cancel", [True, False])
def test_a_lost_session_and_cancel_long_running_tasks_on_connection_loss(
        zookeeper_server: Any, zk_chroot: str, start_worker: Any, task_log: Path,
        cancel: bool) -> None:
    """A ZooKeeper session lost is Celery's connection loss: worker A is cut
    off past its session timeout while it runs an acks_late task, whose
    message B then runs. Back, A's transport says the connection was lost;
    with ``worker_cancel_long_running_tasks_on_connection_loss`` Celery
    terminates the task there (it ran once, by B), without it the task goes
    on in A too (it runs twice: at-least-once, as on every broker)."""
    import json

    from .tcpproxy import TCPProxy

    direct = f"{zookeeper_server.url}{zk_chroot}/lost?session_timeout=2"
    host, port = zookeeper_server.hosts.rsplit(":", 1)
    conf = {"worker_cancel_long_running_tasks_on_connection_loss": cancel}
    with TCPProxy(host, int(port)) as proxy:
        a = start_worker(f"zk://{proxy.hosts}{zk_chroot}/lost?session_timeout=2",
                         log=task_log, name="a", pool="prefork", concurrency=1,
                         env={"CELERY_ZK_TEST_CONF": json.dumps(conf)})
        app = Celery("sender", broker=direct, set_as_current=False)
        try:
            app.send_task("proj.app.timed", args=("long", 8.0))
        finally:
            app.close()
        wait_until(lambda: "long" in _started(task_log), 30)
        proxy.blackhole()
        try:
            time.sleep(4)   # past A's session: the ensemble gives its message back
            start_worker(direct, log=task_log, name="b", concurrency=2)
            wait_until(lambda: _started(task_log).count("long") == 2, 30)
        finally:
            proxy.heal()
        if cancel:   # terminated in A: it never ends there
            wait_until(lambda: "Terminating it instead" in a.output(), 30,
                       message=lambda: a.output()[-3000:])
            wait_until(lambda: "long" in _ended(task_log), 30)
            time.sleep(1)
        else:   # it goes on in A: it ends there too
            wait_until(lambda: _ended(task_log).count("long") == 2, 30,
                       message=lambda: a.output()[-3000:])
        a.stop()   # while its proxy still stands
    assert ("Terminating it instead" in a.output()) == cancel, a.output()[-3000:]
    assert _ended(task_log).count("long") == (1 if cancel else 2)


@pytest.mark.parametrize("handoff", [True, False])
@pytest.mark.parametrize("pool", POOLS)
def test_what_a_busy_worker_looked_ahead_for_goes_back_to_an_idle_one(
        client_app: Celery, worker, task_log: Path, zk_client: KazooClient, pool: str,
        handoff: bool) -> None:
    """A worker whose one slot runs a long task still holds, in its inbox, what
    it looked ahead for in a burst: what would wait there longer than ``HOLD``
    at its pace goes back to the queue, though nothing wakes the busy worker's
    event loop (its offer's look-again does, or without the hand-off its own
    look, ``EVENT_LOOP_POKE``), and an idle worker joining later runs it long
    before the long task ends."""
    busy = worker(log=task_log, pool=pool, concurrency=1, name="busy",
                  conf={"worker_prefetch_multiplier": 1,
                        "broker_transport_options": {"handoff": handoff}})
    for i in range(40):   # a burst drained fast: the busy worker looks ahead
        send(client_app, "record", f"warm-{i}")
    wait_until(lambda: sum(str(v).startswith("warm-") for v in executed_values(task_log)) == 40,
               60)
    send(client_app, "record_then_sleep", "long", 40)
    quick = [f"quick-{i}" for i in range(8)]
    for value in quick:
        send(client_app, "record", value)
    wait_until(lambda: "long" in executed_values(task_log, "record_then_sleep"), 30)
    # Every quick one given to the busy worker: none waits for the idle one to take.
    wait_until(lambda: not waiting(zk_client, LAYOUT, "celery"), 30,
               message="the quick tasks were not all given to the busy worker")
    # All but the one the busy worker's Celery took into its pool's queue.
    wait_until(lambda: len(waiting(zk_client, LAYOUT, "celery")) >= len(quick) - 1, 30,
               message="what the busy worker held did not go back")
    worker(log=task_log, pool=pool, concurrency=2, name="idle")
    # Before the long task ends (40 s after it started).
    wait_until(lambda: sum(v in executed_values(task_log) for v in quick) >= len(quick) - 1,
               30, message="the idle worker did not run what went back")
    busy.kill()   # a warm shutdown would wait out the long task (30 s of teardown)


@pytest.mark.parametrize("pool", POOLS)
def test_a_busy_worker_is_handed_remote_control_commands(
        client_app: Celery, worker, task_log: Path, zk_client: KazooClient, pool: str) -> None:
    """What the remote-control queue delivers takes no pool slot, so a worker
    whose every slot is busy keeps its offer there: a broadcast (a revoke, an
    inspect) is handed straight into its inbox, as to an idle worker, and not
    routed through the queue's dispatcher behind the tasks handed to it."""
    busy = worker(log=task_log, pool=pool, concurrency=1, name="busy")
    pidbox = next(q for q in zk_client.get_children(LAYOUT.queues)
                  if q.startswith("busy@") and q.endswith(".pidbox"))
    send(client_app, "record_then_sleep", "long", 30)
    wait_until(lambda: "long" in executed_values(task_log, "record_then_sleep"), 30)
    time.sleep(0.5)   # busy well past BUSY_GRACE, when a task queue's offer goes
    assert zk_client.get_children(LAYOUT.offers(pidbox)), "the busy worker withdrew its offer"
    before = unowned_creations(zk_client, LAYOUT, pidbox)
    hostname = pidbox.removesuffix(".celery.pidbox")
    assert client_app.control.ping(destination=[hostname], timeout=10)
    assert unowned_creations(zk_client, LAYOUT, pidbox) == before   # handed, never waited
    busy.kill()   # a warm shutdown would wait out the long task
