"""Delayed delivery (celery_zk.broker.delayed): tasks with an eta or countdown wait in
ZooKeeper, not in worker memory, against a real server and real ``celery worker``s."""
from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, group
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kombu import Connection, Consumer, Queue

from celery_zk.broker.channel import encode_message
from celery_zk.ops.exporter import StatusCollector
from celery_zk.ops.status import collect
from celery_zk.zk.layout import Layout
from celery_zk.zk.message_names import DELAYED_DAY_MS

from .workers import celery_cli, read_log, wait_until

LAYOUT = Layout("/")   # zk_client is chrooted at the URL's path
TIMED = "proj.app.timed"   # records when it started (tests/integration/proj/app.py)


@pytest.fixture
def client_app(zk_url: str) -> Iterator[Celery]:
    app = Celery("delayed", broker=zk_url, backend=zk_url, set_as_current=False)
    yield app
    app.close()


def delayed_names(zk_client: KazooClient, queue: str = "celery") -> list[str]:
    """Every name under the queue's delayed/ (day/bucket/name)."""
    root = LAYOUT.delayed(queue)
    found = []
    try:
        days = zk_client.get_children(root)
    except NoNodeError:
        return []
    for day in days:
        for bucket in zk_client.get_children(f"{root}/{day}"):
            found += [f"{day}/{bucket}/{name}"
                      for name in zk_client.get_children(f"{root}/{day}/{bucket}")]
    return found


def queue_status(url: str, queue: str = "celery") -> dict[str, Any]:
    done = celery_cli(["zk", "status", "--json"], url)
    return next(q for q in json.loads(done.stdout)["queues"] if q["name"] == queue)


def exported(url: str) -> dict[str, float]:
    """The exporter's delayed figures of queue celery."""
    with Connection(url) as connection:
        transport = connection.default_channel.connection
        status = collect(transport.handle.client, transport.layout, transport.settings.hosts,
                         queues=["celery"], health=False)
    return {sample.name: sample.value for family in StatusCollector(lambda: status).collect()
            for sample in family.samples if sample.name in (
                "celery_zk_queue_delayed", "celery_zk_queue_next_due_timestamp_seconds")}


def starts(task_log: Path) -> dict[Any, float]:
    return {entry["value"]["value"]: entry["value"]["start"]
            for entry in read_log(task_log) if entry["kind"] == "timed"}


@pytest.mark.parametrize("pool", ["threads", pytest.param("prefork", marks=pytest.mark.matrix)])
def test_countdown_tasks_wait_in_zookeeper_and_run_when_due(
        client_app: Celery, zk_url: str, zk_client: KazooClient, worker, task_log: Path,
        pool: str) -> None:
    running = worker(log=task_log, pool=pool, concurrency=2)
    sent = time.time()
    # Due after the three looks below (two CLI processes, seconds on a loaded
    # machine: at 3 s the first fell due before the exporter read the queue).
    etas = {f"d{index}": sent + 8 + index * 0.5 for index in range(4)}
    for value, eta in etas.items():
        client_app.send_task(TIMED, args=[value], eta=datetime.fromtimestamp(eta, timezone.utc))
    client_app.send_task(TIMED, args=["now"])
    # Stored under delayed/, one bucket per minute of their due times; the worker holds none.
    assert len(delayed_names(zk_client)) == 4
    status = queue_status(zk_url)
    assert status["delayed"] == 4 and abs(status["next_due"] - etas["d0"]) < 0.002
    assert "4 (next in" in celery_cli(["zk", "status"], zk_url).stdout
    assert exported(zk_url) == {"celery_zk_queue_delayed": 4.0,
                                "celery_zk_queue_next_due_timestamp_seconds": status["next_due"]}
    wait_until(lambda: "now" in starts(task_log), 30)
    scheduled = celery_cli(["inspect", "scheduled", "--json"], zk_url)
    assert all(not held for held in json.loads(scheduled.stdout).values()), scheduled.stdout
    wait_until(lambda: len(starts(task_log)) == 5, 30,
               message=lambda: f"ran {starts(task_log)} {delayed_names(zk_client)}; worker:\n"
               + "\n".join(line for line in running.output().splitlines()
                           if "delayed" in line or "ERROR" in line or "Trace" in line))
    ran = starts(task_log)
    for value, eta in etas.items():
        assert ran[value] >= eta - 0.01, (value, ran[value] - eta)   # never before its eta
    assert sorted(etas, key=ran.__getitem__) == list(etas)   # in the order they fell due
    assert sorted(entry["value"]["value"] for entry in read_log(task_log)
                  if entry["kind"] == "timed") == sorted([*etas, "now"])   # each once
    assert delayed_names(zk_client) == [] and queue_status(zk_url)["delayed"] == 0


@pytest.mark.matrix
def test_delayed_tasks_outlive_a_killed_worker_go_ahead_of_the_backlog_and_honour_revokes(
        client_app: Celery, zk_url: str, zk_client: KazooClient, worker, task_log: Path) -> None:
    # Takes its bucket's first sequence number, whose order (0) ties with a promoted
    # message's, as a handed message's does (message_names.MessageName.sort_key).
    client_app.send_task(TIMED, args=["first in its bucket"])
    first = worker(log=task_log, pool="prefork", concurrency=1, name="first")
    sent = time.time()
    countdown = 16   # past the killed worker's session (10 s), so the backlog is one
    high = client_app.send_task(TIMED, args=["high"], countdown=countdown, priority=9)
    low = [client_app.send_task(TIMED, args=[f"low{i}"], countdown=countdown, priority=0)
           for i in range(3)]
    doomed = client_app.send_task(TIMED, args=["revoked"], countdown=countdown)
    client_app.control.revoke(doomed.id)
    assert len(delayed_names(zk_client)) == 5
    os.kill(first.proc.pid, signal.SIGKILL)   # before they are due: nothing was handed
    first.proc.wait()
    consumers = LAYOUT.queue_consumers("celery")
    wait_until(lambda: not zk_client.get_children(consumers), 30)   # its session ended
    for index in range(5):   # a backlog with no consumer, behind which they fall due
        client_app.send_task(TIMED, args=[f"backlog{index}"])
    time.sleep(max(0.0, countdown + 0.5 - (time.time() - sent)))
    second = worker(log=task_log, pool="prefork", concurrency=1, name="second")
    wait_until(lambda: len(starts(task_log)) == 10, 60,
               message=lambda: f"ran {starts(task_log)}; worker:\n{second.output()[-3000:]}")
    ran = starts(task_log)
    order = sorted(ran, key=ran.__getitem__)[1:]
    # Due, they went ahead of the backlog, the high priority first; the revoked one not at all.
    assert order[:4] == ["high", "low0", "low1", "low2"], order
    wait_until(lambda: doomed.state == "REVOKED", 30)
    assert "revoked" not in starts(task_log)
    assert high.get(timeout=30) == "high" and [r.get(timeout=30) for r in low]
    assert delayed_names(zk_client) == []


def test_buckets_and_days_gone_by_are_deleted_once_promoted(
        zk_url: str, zk_client: KazooClient) -> None:
    """Messages due in a minute and a day gone by (as a dispatcher that was away
    finds them) are delivered, and what held them is deleted."""
    queue = Queue("late")
    with Connection(zk_url) as connection:
        channel = connection.channel()
        queue(channel).declare()
        publisher = channel.connection.publisher
        now = int(time.time() * 1000)
        for value, due in (("yesterday", now - DELAYED_DAY_MS), ("a minute ago", now - 61_000)):
            raw = channel.prepare_message(json.dumps(value), content_type="application/json")
            raw["properties"]["delivery_info"] = {"routing_key": "late", "exchange": ""}
            publisher.put_new(publisher.new_message("late", encode_message(raw), None, due=due))
        names = delayed_names(zk_client, "late")
        assert len(names) == 2 and len({name.split("/")[0] for name in names}) == 2
        got: list[Any] = []
        with Consumer(connection, [queue], callbacks=[lambda body, m: (got.append(body),
                                                                        m.ack())]):
            deadline = time.monotonic() + 30
            while len(got) < 2 and time.monotonic() < deadline:
                try:
                    connection.drain_events(timeout=1)
                except TimeoutError:
                    pass
            assert got == ["yesterday", "a minute ago"]   # earliest due first
            wait_until(lambda: zk_client.get_children(LAYOUT.delayed("late")) == [today()], 30,
                       message=lambda: str(zk_client.get_children(LAYOUT.delayed("late"))))
            day = f"{LAYOUT.delayed('late')}/{today()}"
            wait_until(lambda: zk_client.get_children(day) == [], 30)


def today() -> str:
    return f"{int(time.time() * 1000) // DELAYED_DAY_MS:05d}"


def test_a_naive_or_near_eta_is_delivered_at_once(
        client_app: Celery, zk_url: str, zk_client: KazooClient, worker, task_log: Path) -> None:
    """An eta without a timezone (the app's, unknown to the broker) or under a second
    ahead goes to the worker at once, which waits for it, as on any broker."""
    near = client_app.send_task(TIMED, args=["near"], countdown=0.5)
    naive = client_app.send_task(TIMED, args=["naive"], eta=datetime.now(
        timezone.utc).replace(tzinfo=None) + timedelta(seconds=3))
    assert delayed_names(zk_client) == []
    worker(log=task_log, pool="threads")
    assert near.get(timeout=30) == "near" and naive.get(timeout=30) == "naive"


def test_singles_groups_and_unconfirmed_publishes_roll_delayed_buckets_and_run_once(
        zk_url: str, zk_client: KazooClient, start_worker, task_log: Path) -> None:
    """Every publish path (one at a time, a group's multis, pipelined with
    confirm_publish=false) delays its messages, a bucket of 5 rolling over to
    the next generation as unowned/'s do; each runs once."""
    url = f"{zk_url}?bucket_size=5"
    confirmed = Celery("delayed", broker=url, backend=zk_url, set_as_current=False)
    pipelined = Celery("delayed", broker=f"{url}&confirm_publish=false",
                       set_as_current=False)
    try:
        eta = datetime.fromtimestamp(time.time() + 4, timezone.utc)
        for index in range(12):
            confirmed.send_task(TIMED, args=[f"single{index}"], eta=eta)
        group(confirmed.signature(TIMED, args=[f"group{index}"]).set(eta=eta)
              for index in range(12)).apply_async()
        for index in range(6):
            pipelined.send_task(TIMED, args=[f"pipelined{index}"], eta=eta)
        pipelined.close()   # waits for the pipelined publishes
        names = delayed_names(zk_client)
        assert len(names) == 30
        buckets = {name.rpartition("/")[0] for name in names}
        assert len(buckets) >= 3, buckets   # generations of the one minute (or two)
        start_worker(url, backend=zk_url, log=task_log, pool="threads", concurrency=4)
        wait_until(lambda: len(starts(task_log)) == 30, 60,
                   message=lambda: f"ran {sorted(starts(task_log))}")
        time.sleep(0.5)
        values = [entry["value"]["value"] for entry in read_log(task_log)
                  if entry["kind"] == "timed"]
        assert len(values) == 30 and min(starts(task_log).values()) >= eta.timestamp() - 0.01
        assert delayed_names(zk_client) == []
    finally:
        confirmed.close()
