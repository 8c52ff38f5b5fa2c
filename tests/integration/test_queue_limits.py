"""Queue limits and message lifetimes as RabbitMQ defines them
(celery_zk.broker.queue_arguments, celery_zk.broker.queue_limits), with real
``celery worker`` processes (threads and prefork) against a real server."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Queue

from celery_zk.exceptions import QueueFull

from .workers import celery_cli, executed_values, wait_until

RECORD = "proj.app.record"   # the test workers' task (tests/integration/proj/app.py)


@pytest.fixture
def client_app(zk_url: str) -> Iterator[Celery]:
    app = Celery("limits", broker=zk_url, set_as_current=False)
    yield app
    app.close()


def _queues(conf: dict[str, Any]) -> list[Queue]:
    return [Queue(name, queue_arguments=arguments) for name, arguments in conf.items()]


def _worker_conf(queues: dict[str, dict[str, Any]], dead_letter: bool = False) -> dict[str, Any]:
    conf: dict[str, Any] = {"task_queues": {name: {"queue_arguments": arguments}
                                            for name, arguments in queues.items()}}
    if dead_letter:
        conf["broker_transport_options"] = {"dead_letter_rejected": True}
    return conf


def _queue_status(url: str, queue: str) -> dict[str, Any]:
    done = celery_cli(["zk", "status", "--json"], url)
    return next(q for q in json.loads(done.stdout)["queues"] if q["name"] == queue)


@pytest.mark.parametrize("pool", ["threads", pytest.param("prefork", marks=pytest.mark.matrix)])
def test_max_length_drop_head_keeps_the_newest(client_app: Celery, zk_url: str, worker,
                                                task_log: Path, pool: str) -> None:
    arguments = {"lim": {"x-max-length": 5}}
    client_app.conf.task_queues = _queues(arguments)
    for index in range(20):   # no consumer yet: the oldest 15 are dropped
        client_app.send_task(RECORD, args=[index], queue="lim")
    status = _queue_status(zk_url, "lim")
    assert status["waiting"] == 5 and status["dropped"] == 15
    assert status["arguments"] == {"x-max-length": 5}
    worker(log=task_log, pool=pool, queues="lim", conf=_worker_conf(arguments))
    wait_until(lambda: len(executed_values(task_log)) >= 5, 60)
    time.sleep(0.5)
    assert executed_values(task_log) == {index: 1 for index in range(15, 20)}
    text = celery_cli(["zk", "status"], zk_url).stdout
    assert "max-length=5" in text and "0/15" in text


@pytest.mark.matrix
def test_max_length_reject_publish_refuses_with_a_clear_error(
        client_app: Celery, zk_url: str, worker, task_log: Path) -> None:
    arguments = {"full": {"x-max-length": 3, "x-overflow": "reject-publish"}}
    client_app.conf.task_queues = _queues(arguments)
    for index in range(3):
        client_app.send_task(RECORD, args=[index], queue="full")
    with pytest.raises(QueueFull) as refused:
        client_app.send_task(RECORD, args=[99], queue="full")
    assert "'full'" in str(refused.value) and "x-max-length is 3" in str(refused.value)
    assert "Nothing was written" in str(refused.value)
    worker(log=task_log, pool="prefork", queues="full", conf=_worker_conf(arguments))
    wait_until(lambda: len(executed_values(task_log)) >= 3, 60)
    client_app.send_task(RECORD, args=[100], queue="full")   # room again: accepted
    wait_until(lambda: 100 in executed_values(task_log), 60)
    assert executed_values(task_log) == {0: 1, 1: 1, 2: 1, 100: 1}


@pytest.mark.parametrize("pool", [pytest.param("threads", marks=pytest.mark.matrix), "prefork"])
def test_expired_messages_are_never_delivered(client_app: Celery, zk_url: str, worker,
                                              task_log: Path, pool: str) -> None:
    """A queue's x-message-ttl and a task's ``expires`` (Celery sends it as the
    message's expiration): the worker never receives them; they go to dead/
    (dead_letter_rejected) and are counted."""
    arguments = {"ttl": {"x-message-ttl": 1000}}
    client_app.conf.task_queues = _queues(arguments)
    old = [client_app.send_task(RECORD, args=[f"old-{i}"], queue="ttl").id for i in range(3)]
    own = [client_app.send_task(RECORD, args=[f"own-{i}"], queue="celery", expires=1).id
           for i in range(2)]
    time.sleep(1.5)
    w = worker(log=task_log, pool=pool, queues="ttl,celery",
               conf=_worker_conf(arguments, dead_letter=True))
    # Sent once the worker is up: well within their second.
    fresh = client_app.send_task(RECORD, args=["fresh"], queue="ttl")
    lasting = client_app.send_task(RECORD, args=["lasting"], queue="celery", expires=600)
    wait_until(lambda: {"fresh", "lasting"} <= set(executed_values(task_log)), 60,
               message=lambda: w.diagnosis())
    wait_until(lambda: _queue_status(zk_url, "ttl")["expired"] == 3
               and _queue_status(zk_url, "celery")["expired"] == 2, 30)
    assert set(executed_values(task_log)) == {"fresh", "lasting"}
    output = w.output()
    assert fresh.id in output and lasting.id in output
    assert not [task_id for task_id in old + own if task_id in output]   # never received
    assert _queue_status(zk_url, "ttl")["dead"] == 3
    dead = celery_cli(["zk", "dead", "list", "ttl"], zk_url).stdout
    assert "expired: the queue's x-message-ttl of 1000 ms" in dead, dead


@pytest.mark.matrix
def test_bad_queue_arguments_fail_before_anything_is_stored(client_app: Celery) -> None:
    from celery_zk.exceptions import ZKConfigurationError

    client_app.conf.task_queues = [Queue("bad", queue_arguments={"x-overflow": "drop-tail"})]
    with pytest.raises(ZKConfigurationError, match="x-overflow must be one of"):
        client_app.send_task(RECORD, args=[1], queue="bad")


def test_a_later_declaration_keeps_the_stored_arguments(
        zk_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """As on RabbitMQ, the first declaration's arguments stay; a process that
    declares the queue with others is told so, and applies the stored ones."""
    from kombu import Connection

    with Connection(zk_url) as first:
        Queue("kept", max_length=2)(first.default_channel).declare()
    with Connection(f"{zk_url}?session_name=other") as other:
        with caplog.at_level("WARNING", logger="celery_zk"):
            Queue("kept", max_length=50)(other.default_channel).declare()
        assert any("exists with" in r.getMessage() and "max_length=2" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        producer = other.Producer()
        for index in range(5):
            producer.publish({"i": index}, routing_key="kept")
        assert other.default_channel._size("kept") == 2   # drop-head at the stored 2


PAYLOAD = "x" * 1000   # a task's body of ~1,100 bytes: 4 fit in 5,000, not 5


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_max_length_bytes_drop_head_keeps_the_newest(client_app: Celery, zk_url: str, worker,
                                                      task_log: Path, pool: str) -> None:
    """x-max-length-bytes counts the bodies of the messages waiting (as
    RabbitMQ): over it, the oldest are dropped until they fit."""
    arguments = {"small": {"x-max-length-bytes": 5000}}
    client_app.conf.task_queues = _queues(arguments)
    for index in range(12):   # no consumer yet: the oldest 8 are dropped
        client_app.send_task(RECORD, args=[index, PAYLOAD], queue="small")
    status = _queue_status(zk_url, "small")
    assert status["waiting"] == 4 and status["dropped"] == 8, status
    worker(log=task_log, pool=pool, queues="small", conf=_worker_conf(arguments))
    wait_until(lambda: len(executed_values(task_log)) >= 4, 60)
    time.sleep(0.5)
    assert executed_values(task_log) == {index: 1 for index in range(8, 12)}
    assert "max-length-bytes=5000" in celery_cli(["zk", "status"], zk_url).stdout


def test_max_length_bytes_reject_publish_and_a_requeue_keeps_its_size(
        client_app: Celery, zk_url: str, worker, task_log: Path) -> None:
    """reject-publish refuses the message that would not fit, naming the
    bytes; a message that goes back to wait (a reject with requeue) still
    counts its bytes; drained, the queue takes them again."""
    from kombu import Connection

    from celery_zk.ops.exporter import StatusCollector
    from celery_zk.ops.status import collect

    arguments = {"tight": {"x-max-length-bytes": 2500, "x-overflow": "reject-publish"}}
    client_app.conf.task_queues = _queues(arguments)
    for index in range(2):
        client_app.send_task(RECORD, args=[index, PAYLOAD], queue="tight")
    with pytest.raises(QueueFull) as refused:
        client_app.send_task(RECORD, args=[2, PAYLOAD], queue="tight")
    assert "x-max-length-bytes is 2,500" in str(refused.value), refused.value
    assert "Nothing was written" in str(refused.value)
    client_app.send_task(RECORD, args=[3], queue="tight")   # a small one still fits
    with Connection(zk_url) as conn:
        queue = Queue("tight", queue_arguments=arguments["tight"])(conn.default_channel)
        message = queue.get()
        assert message is not None
        message.reject(requeue=True)   # back in its place, its size with it
    with pytest.raises(QueueFull):
        client_app.send_task(RECORD, args=[4, PAYLOAD], queue="tight")
    assert _queue_status(zk_url, "tight")["waiting"] == 3
    with Connection(zk_url) as conn:
        transport = conn.default_channel.connection
        status = collect(transport.handle.client, transport.layout, transport.settings.hosts,
                         queues=["tight"], health=False)
        assert [s.value for f in StatusCollector(lambda: status).collect() for s in f.samples
                if s.name == "celery_zk_queue_limit"
                and s.labels["argument"] == "x-max-length-bytes"] == [2500]
    worker(log=task_log, pool="prefork", queues="tight", conf=_worker_conf(arguments))
    wait_until(lambda: len(executed_values(task_log)) >= 3, 60)
    client_app.send_task(RECORD, args=[5, PAYLOAD], queue="tight")   # room again
    wait_until(lambda: 5 in executed_values(task_log), 60)
    assert executed_values(task_log) == {0: 1, 1: 1, 3: 1, 5: 1}


def _has_queue(url: str, queue: str) -> bool:
    from kombu import Connection

    with Connection(url) as conn:
        return bool(conn.default_channel._has_queue(queue))


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_x_expires_deletes_a_durable_queue_once_unused(client_app: Celery, zk_url: str, worker,
                                                        task_log: Path, pool: str) -> None:
    """A durable queue with x-expires goes, messages and bindings with it, once
    it had no consumer and no declaration for that long (not before); a
    queue a worker consumes stays, and goes that long after its consumer was
    cancelled."""
    arguments = {"idle": {"x-expires": 1500}, "busy": {"x-expires": 1500}}
    client_app.conf.task_queues = _queues(arguments)
    conf = _worker_conf(arguments)
    conf["broker_transport_options"] = {"expire_every": 0.3}
    w = worker(log=task_log, pool=pool, queues="celery,busy", conf=conf)
    declared = time.monotonic()
    for index in range(3):
        client_app.send_task(RECORD, args=[index], queue="idle")   # nobody consumes it
    wait_until(lambda: not _has_queue(zk_url, "idle"), 30, message=lambda: w.diagnosis())
    assert time.monotonic() - declared >= 1.5
    assert "queue 'idle' deleted: unused for its x-expires of 1500 ms (3 waiting" in w.output()
    names = [q["name"] for q in json.loads(
        celery_cli(["zk", "status", "--json"], zk_url).stdout)["queues"]]
    assert "idle" not in names and "busy" in names   # consumed: in use
    client_app.send_task(RECORD, args=["busy"], queue="busy")
    wait_until(lambda: "busy" in executed_values(task_log), 60)
    time.sleep(2)   # consumed for longer than x-expires since the last declaration
    assert _has_queue(zk_url, "busy")
    cancelling = time.monotonic()   # the consumer goes after this, before the reply
    replies = client_app.control.cancel_consumer("busy", reply=True, limit=1, timeout=10)
    assert replies and "ok" in list(replies[0].values())[0], replies
    wait_until(lambda: not _has_queue(zk_url, "busy"), 30, message=lambda: w.diagnosis())
    assert time.monotonic() - cancelling >= 1.5
    assert _has_queue(zk_url, "celery")   # no x-expires: stays
