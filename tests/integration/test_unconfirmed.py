"""confirm_publish=False: pipelined publishes that still arrive once, in order."""
from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss
from kombu import Connection, Exchange, Producer, Queue

from celery_zk.zk.layout import Layout
from celery_zk.zk.message_names import parse_message_name

from .queues import stored_body, waiting
from .workers import HERE, executed_values, wait_until

LAYOUT = Layout("/")  # zk_client is chrooted at the URL's path


def decode(raw: bytes) -> Any:
    """The JSON body of a stored kombu message."""
    message = json.loads(raw)
    body = message["body"]
    if message.get("properties", {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    return json.loads(body)


def stored_bodies(zk_client: KazooClient, queue: str) -> list[Any]:
    names = waiting(zk_client, LAYOUT, queue)
    assert all(parse_message_name(n) for n in names)
    return [decode(stored_body(zk_client, LAYOUT, queue, n)[0]) for n in names]


def test_pipelined_publishes_all_arrive_in_order(zk_url: str, zk_client: KazooClient) -> None:
    queue = Queue("pipelined", Exchange("pipelined", "direct"), "pipelined")
    with Connection(zk_url + "?confirm_publish=false") as conn:
        producer = Producer(conn.channel(), serializer="json")
        for i in range(600):  # more than the window: publishes wait for replies too
            producer.publish(i, exchange=queue.exchange, routing_key="pipelined",
                             declare=[queue])
        assert conn.transport.unconfirmed is not None
    # Closing waited for every reply.
    assert stored_bodies(zk_client, "pipelined") == list(range(600))


def test_a_lost_reply_is_redone_without_a_duplicate(
        zk_url: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    with Connection(zk_url + "?confirm_publish=false") as conn:
        transport = conn.transport
        transport.queues.declare("lossy-pub")
        client = transport.handle.client
        real_create_async = client.create_async
        lost: list[str] = []

        def create_then_lose_reply(path: str, *args: Any, **kwargs: Any) -> Any:
            result = real_create_async(path, *args, **kwargs)
            if not lost:
                lost.append(result.get())  # it was made; the reply goes missing
                broken = client.handler.async_result()
                broken.set_exception(ConnectionLoss())
                return broken
            return result

        monkeypatch.setattr(client, "create_async", create_then_lose_reply)
        publisher = transport.unconfirmed
        assert publisher is not None
        for i in range(3):
            publisher.put(transport.publisher.new_message(
                "lossy-pub", json.dumps({"body": json.dumps(i)}).encode(), None))
        assert publisher.flush(timeout=10)
    assert lost
    assert stored_bodies(zk_client, "lossy-pub") == [0, 1, 2]


def test_a_refused_publish_is_redone_without_looking_for_it(
        zk_url: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A refused multi stored nothing (all or nothing): redone at once, and not
    reported as a lost reply (a benchmark's preload logged dozens so when its
    bucket rolled under publishes in flight)."""
    from celery_zk.broker.publish import NewMessage

    add_to = NewMessage.add_to
    refused: list[str] = []

    def refused_once(self: NewMessage, txn: Any, layout: Layout) -> None:
        if not refused:
            refused.append(self.uid)
            txn.check("/no-such-node", -1)   # the multi fails on this, storing nothing
        add_to(self, txn, layout)

    monkeypatch.setattr(NewMessage, "add_to", refused_once)
    with Connection(zk_url + "?confirm_publish=false") as conn:
        transport = conn.transport
        transport.queues.declare("refused-pub")
        publisher = transport.unconfirmed
        assert publisher is not None
        looked: list[bool] = []
        put_new = transport.publisher.put_new

        def spy(message: Any, maybe_made: bool = False) -> str:
            looked.append(maybe_made)
            return put_new(message, maybe_made)
        monkeypatch.setattr(transport.publisher, "put_new", spy)
        for i in range(3):
            publisher.put(transport.publisher.new_message(
                "refused-pub", json.dumps({"body": json.dumps(i)}).encode(), None))
        assert publisher.flush(timeout=10)
    assert refused and looked == [False]
    assert sorted(stored_bodies(zk_client, "refused-pub")) == [0, 1, 2]
    assert "reply to a publish was lost" not in caplog.text


def test_a_publish_to_an_undeclared_queue_declares_it(zk_url: str,
                                                      zk_client: KazooClient) -> None:
    with Connection(zk_url + "?confirm_publish=false") as conn:
        publisher = conn.transport.unconfirmed
        assert publisher is not None
        publisher.put(conn.transport.publisher.new_message(
            "undeclared-pub", json.dumps({"body": "1"}).encode(), None))
        assert publisher.flush(timeout=10)
    assert stored_bodies(zk_client, "undeclared-pub") == [1]


def test_a_process_that_exits_without_closing_delivers_everything(
        zk_url: str, zk_client: KazooClient) -> None:
    """Celery's producer pool is not closed at exit: the exit hook waits for the replies."""
    script = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
import celery_zk
from celery import Celery
from proj.app import send_creates_late

# Every create is sent 0.3 s late (a slow network): without the hook the process
# would exit while all of them are still waiting to go out.
send_creates_late(0.3)

app = Celery('pub', broker={zk_url + "?confirm_publish=false"!r})
for i in range(200):
    app.send_task('anything', args=(i,), queue='exit-pub')
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    # Sorted: the timers above send in no particular order (publish order is tested above).
    assert sorted(body[0][0] for body in stored_bodies(zk_client, "exit-pub")) == list(
        range(200))


def test_a_prefork_child_that_exits_after_its_task_delivers_its_subtasks(
        zk_url: str, start_worker: Any, task_log: Path) -> None:
    """A pool child's publishes are flushed when the child exits (here after each
    task, --max-tasks-per-child=1), although billiard ends a child with os._exit."""
    publisher = start_worker(
        zk_url + "?confirm_publish=false", name="fan", pool="prefork", concurrency=1,
        queues="fan", extra_args=["--max-tasks-per-child=1"],
        env={"CELERY_ZK_TEST_LATE_CREATES": "0.3"})
    start_worker(zk_url, log=task_log, name="subtasks", queues="celery")
    app = Celery("client", broker=zk_url)
    try:
        app.send_task("proj.app.fanout_subtasks", args=(30,), queue="fan")
        wanted = {f"sub-{i}" for i in range(30)}
        wait_until(lambda: set(executed_values(task_log)) >= wanted, 30,
                   message=f"subtasks ran: {sorted(executed_values(task_log))}; "
                           f"publisher output:\n{publisher.output()[-3000:]}")
    finally:
        app.close()
