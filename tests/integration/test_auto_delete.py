"""Auto-delete queues (pidbox, reply, events) live exactly as long as a session holds them."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from kazoo.client import KazooClient
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_zk.broker import autodelete
from celery_zk.zk.layout import Layout

from .queues import waiting
from .workers import wait_until

LAYOUT = Layout("/")  # zk_client is chrooted at the URL's path


def declare_auto_delete(connection: Connection, name: str) -> Queue:
    queue = Queue(name, Exchange(name, "direct"), name, auto_delete=True)
    queue(connection.channel()).declare()
    return queue


def test_a_clean_close_deletes_the_queue_only_when_no_one_else_holds_it(
        zk_url: str, zk_client: KazooClient) -> None:
    first, second = Connection(zk_url), Connection(zk_url)
    try:
        declare_auto_delete(first, "shared-ad")
        declare_auto_delete(second, "shared-ad")
        assert len(zk_client.get_children(LAYOUT.holders("shared-ad"))) == 2
        first.close()
        assert zk_client.get_children(LAYOUT.holders("shared-ad")) != []  # second holds it
        assert zk_client.exists(LAYOUT.unowned("shared-ad")) is not None
    finally:
        first.close()
        second.close()
    assert zk_client.exists(LAYOUT.queue("shared-ad")) is None


def test_a_durable_queue_declared_auto_delete_elsewhere_is_never_deleted(
        zk_url: str, zk_client: KazooClient) -> None:
    durable = Queue("keep-me", Exchange("keep-me", "direct"), "keep-me")
    with Connection(zk_url) as owner:
        Producer(owner.channel()).publish({"x": 1}, exchange=durable.exchange,
                                          routing_key="keep-me", declare=[durable])
    with Connection(zk_url) as other:
        declare_auto_delete(other, "keep-me")
        assert zk_client.exists(LAYOUT.holders("keep-me")) is None
    assert len(waiting(zk_client, LAYOUT, "keep-me")) == 1  # message kept
    with Connection(zk_url) as sweeper:
        assert sweeper.transport.auto_delete.sweep() == 0
    assert len(waiting(zk_client, LAYOUT, "keep-me")) == 1


def test_sweep_deletes_unheld_queues_with_their_messages_in_batches(
        zk_url: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(autodelete, "DELETE_BATCH", 3)
    with Connection(zk_url) as holder, Connection(zk_url) as sweeper:
        queue = declare_auto_delete(holder, "orphan")
        declare_auto_delete(holder, "still-held")
        producer = Producer(holder.channel())
        for i in range(8):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="orphan")
        # The holder's session "ends" for this queue only: remove its holder by hand.
        for name in zk_client.get_children(LAYOUT.holders("orphan")):
            zk_client.delete(f"{LAYOUT.holders('orphan')}/{name}")
        assert sweeper.transport.auto_delete.sweep() == 1
        assert zk_client.exists(LAYOUT.queue("orphan")) is None
        assert zk_client.exists(LAYOUT.unowned("still-held")) is not None


def test_a_held_queue_is_not_deleted(zk_url: str, zk_client: KazooClient) -> None:
    with Connection(zk_url) as holder, Connection(zk_url) as other:
        declare_auto_delete(holder, "held")
        assert other.transport.auto_delete.delete_if_unheld("held") is False
        assert zk_client.exists(LAYOUT.unowned("held")) is not None


def test_a_holder_that_comes_while_the_queue_is_listed_keeps_it(
        zk_url: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session that declares the queue again between the sweep's look at
    ``holders/`` and its listing of the queue: the guard (``holders/`` deleted
    first in the multi) fails on its holder and the queue stays, holder and
    messages too."""
    with Connection(zk_url) as holder, Connection(zk_url) as sweeper:
        queue = declare_auto_delete(holder, "comes-back")
        Producer(holder.channel()).publish({"x": 1}, exchange=queue.exchange,
                                           routing_key="comes-back")
        holders = LAYOUT.holders("comes-back")
        for name in zk_client.get_children(holders):
            zk_client.delete(f"{holders}/{name}")
        listed = autodelete.list_tree

        def list_after_a_new_holder(client: KazooClient, path: str) -> list[str] | None:
            zk_client.create(f"{holders}/s1-back", ephemeral=True)
            return listed(client, path)

        monkeypatch.setattr(autodelete, "list_tree", list_after_a_new_holder)
        assert sweeper.transport.auto_delete.delete_if_unheld("comes-back") is False
        assert zk_client.get_children(holders) == ["s1-back"]
        assert len(waiting(zk_client, LAYOUT, "comes-back")) == 1


def test_queues_of_a_killed_process_are_deleted_by_the_leader(
        zk_url: str, zk_client: KazooClient) -> None:
    """SIGKILL a process consuming an auto-delete queue: a survivor deletes the queue."""
    url = zk_url + "?session_timeout=2"
    script = f"""
import sys, time, celery_zk
from kombu import Connection, Consumer, Exchange, Producer, Queue
c = Connection({url!r})
q = Queue('doomed-ad', Exchange('doomed-bc', 'fanout'), auto_delete=True)
with Consumer(c, [q], callbacks=[lambda body, message: None], prefetch_count=1):
    Producer(c.channel()).publish({{'left': 'behind'}}, exchange='', routing_key='doomed-ad')
    print('ready', flush=True)
    time.sleep(60)
"""
    with Connection(url) as survivor:
        # The survivor consumes too: only live consumers take part in the leader election.
        mine = Queue("survivor-q", Exchange("survivor-q", "direct"), "survivor-q")
        with Consumer(survivor, [mine], callbacks=[lambda body, message: None]):
            with pytest.raises(socket.timeout):
                survivor.drain_events(timeout=0.2)
            doomed = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                      text=True)
            try:
                assert doomed.stdout is not None and doomed.stdout.readline() == "ready\n"
                assert zk_client.get_children(LAYOUT.holders("doomed-ad")) != []
                doomed.kill()
                doomed.wait(10)
                killed = time.monotonic()
                wait_until(lambda: zk_client.exists(LAYOUT.queue("doomed-ad")) is None, 15,
                           interval=0.05)
                seconds = time.monotonic() - killed
            finally:
                doomed.kill()
                doomed.wait(10)
    print(f"auto-delete queue of a SIGKILLed process deleted after {seconds:.1f} s "
          "(session timeout 2 s)")
    assert zk_client.exists(LAYOUT.queue("survivor-q")) is not None
    assert zk_client.get_children(LAYOUT.bindings("doomed-bc")) == []
