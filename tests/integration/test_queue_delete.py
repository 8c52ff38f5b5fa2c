"""Deleting a subtree (a queue, an exchange, a chord counter): in as few transactions as fit.

Celery's remote control makes and deletes a reply queue on every ``inspect``
or ``control`` call (kombu's ``after_reply_message_received``), so how a queue
is deleted is paid for on every such call.
"""
from __future__ import annotations

import pytest
from kazoo.client import KazooClient
from kombu import Connection, Exchange, Producer, Queue

from celery_zk.zk import tree
from celery_zk.zk.layout import Layout

from .queues import waiting

LAYOUT = Layout("/")  # zk_client is chrooted at the URL's path


def transactions_during(zk_client: KazooClient, action: object) -> int:
    """Transactions the server logged while ``action()`` ran: the zxids of two
    marker nodes made around it, less the first marker's own (ZooKeeper gives
    every transaction the next zxid; nothing else writes to this test's server
    meanwhile)."""
    zk_client.ensure_path("/markers")
    before = zk_client.create("/markers/m-", sequence=True, ephemeral=True)
    action()  # type: ignore[operator]
    after = zk_client.create("/markers/m-", sequence=True, ephemeral=True)
    first, last = zk_client.exists(before), zk_client.exists(after)
    assert first is not None and last is not None
    return last.czxid - first.czxid - 1


def publish(connection: Connection, queue: Queue, count: int) -> None:
    producer = Producer(connection.channel())
    for index in range(count):
        producer.publish({"index": index}, exchange=queue.exchange,
                         routing_key=queue.routing_key, declare=[queue])


def test_a_queue_and_its_messages_go_in_one_transaction(
        zk_url: str, zk_client: KazooClient) -> None:
    queue = Queue("doomed", Exchange("doomed", "direct"), "doomed")
    with Connection(zk_url) as connection:
        publish(connection, queue, 3)
        assert len(waiting(zk_client, LAYOUT, "doomed")) == 3
        channel = connection.channel()
        count = transactions_during(zk_client, lambda: channel.queue_delete("doomed"))
    assert zk_client.exists(LAYOUT.queue("doomed")) is None
    # Its binding's delete and one multi for the queue's tree (node by node, as
    # kazoo's recursive delete goes, it was 17 in all).
    assert count == 2


def test_a_queue_larger_than_one_transaction_goes_in_batches(
        zk_url: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree, "DELETE_BATCH", 4)
    queue = Queue("backlog", Exchange("backlog", "direct"), "backlog")
    with Connection(zk_url) as connection:
        publish(connection, queue, 10)
        connection.channel().queue_delete("backlog")
    assert zk_client.exists(LAYOUT.queue("backlog")) is None


def test_an_exchange_goes_with_its_bindings(zk_url: str, zk_client: KazooClient) -> None:
    exchange = Exchange("gone-ex", "topic")
    with Connection(zk_url) as connection:
        channel = connection.channel()
        for key in ("a.#", "b.*"):
            Queue(f"q-{key}", exchange, key)(channel).declare()
        assert len(zk_client.get_children(LAYOUT.bindings("gone-ex"))) == 2
        exchange(channel).delete()
    assert zk_client.exists(LAYOUT.exchange("gone-ex")) is None


def test_an_expired_chord_counter_goes_with_its_parts_in_one_transaction(
        zk_url: str, zk_client: KazooClient) -> None:
    from celery import Celery

    from celery_zk.backend import ZooKeeperBackend
    from celery_zk.backend.chord import ChordCounter

    app = Celery("t", broker=zk_url, backend=zk_url, set_as_current=False)
    backend = app.backend
    assert isinstance(backend, ZooKeeperBackend)
    counter = ChordCounter(backend.client, backend.layout, "chord-gone")
    for index in range(3):
        counter.increment(f"part-{index}", index)
    key = backend.get_key_for_chord("chord-gone")
    assert len(zk_client.get_children(LAYOUT.chord("chord-gone"))) >= 3
    # What the expiry pass does with a chord's counter (backend.delete keeps it).
    count = transactions_during(zk_client, lambda: backend._delete_key(key))
    assert zk_client.exists(LAYOUT.chord("chord-gone")) is None
    assert count == 1
    app.close()


def test_deleting_what_is_not_there_is_no_error(zk_client: KazooClient) -> None:
    assert tree.delete_tree(zk_client, "/not-there") is False
    zk_client.ensure_path("/one/two/three")
    assert tree.delete_tree(zk_client, "/one") is True
    assert zk_client.exists("/one") is None
