"""Groups and chord headers stored a few hundred messages per multi (celery_zk.broker.groups).

ZooKeeper gives every node a multi creates the same czxid, so the number of
distinct czxids among a group's messages is the number of transactions that
stored them, as the server saw it.
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chain, chord, group
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss
from kombu import Connection

from celery_zk.exceptions import MessageTooLarge
from celery_zk.zk.layout import Layout

from .queues import buckets, stored_body, waiting
from .test_unconfirmed import decode

#: In every cell of the version matrix (tox.ini).
pytestmark = pytest.mark.matrix

LAYOUT = Layout("/")  # zk_client is chrooted at the URL's path


@contextmanager
def client_app(broker: str, backend: str | None = None) -> Iterator[Celery]:
    app = Celery("groups-client", broker=broker, backend=backend, set_as_current=False)
    app.conf.task_serializer = "json"
    try:
        yield app
    finally:
        app.close()


def sig(app: Celery, value: Any, queue: str) -> Any:
    return app.signature("proj.app.record", args=(value,), queue=queue)


def stored(zk_client: KazooClient, queue: str) -> list[tuple[Any, int]]:
    """(first argument, czxid) of each waiting message, in delivery order."""
    out = []
    for name in waiting(zk_client, LAYOUT, queue):
        data, stat = stored_body(zk_client, LAYOUT, queue, name)
        out.append((decode(data)[0][0], stat.czxid))
    return out


def transactions(items: list[tuple[Any, int]]) -> int:
    return len({czxid for _, czxid in items})


@pytest.mark.parametrize(("options", "size", "multis"), [
    ("", 600, 3),                          # 256 per multi, not 600 creates
    ("?confirm_publish=false", 300, 2),    # stored, not pipelined, by its end
    ("?batch_groups=false", 20, 20),       # turned off: task by task
])
def test_a_group_is_stored_in_a_few_multis_and_in_order(
        zk_url: str, zk_client: KazooClient, options: str, size: int, multis: int) -> None:
    with client_app(zk_url + options) as app:
        group([sig(app, i, "grp") for i in range(size)]).apply_async()
        # apply_async returned: every message is stored, nothing left to flush.
        items = stored(zk_client, "grp")
    assert [value for value, _ in items] == list(range(size))
    assert transactions(items) == multis


def test_a_group_rolls_to_new_buckets_and_keeps_their_bound(
        zk_url: str, zk_client: KazooClient) -> None:
    with client_app(zk_url + "?bucket_size=5") as app:
        group([sig(app, i, "grp-roll") for i in range(23)]).apply_async()
        items = stored(zk_client, "grp-roll")
    assert [value for value, _ in items] == list(range(23))
    sizes = [len(zk_client.get_children(path)) for path in buckets(zk_client, LAYOUT, "grp-roll")]
    assert sizes == [5, 5, 5, 5, 3]


def test_big_messages_are_split_into_multis_that_fit(
        zk_url: str, zk_client: KazooClient) -> None:
    """Twelve messages of ~101 KB encoded (base64; below chunk_size, so stored
    whole): nine fit in one 1 MB multi, ten would not."""
    with client_app(zk_url) as app:
        group([sig(app, [i, "x" * 75_000], "grp-big") for i in range(12)]).apply_async()
        items = stored(zk_client, "grp-big")
    assert [value[0] for value, _ in items] == list(range(12))
    assert transactions(items) == 2


def test_messages_bigger_than_a_chunk_in_a_group(zk_url: str, zk_client: KazooClient) -> None:
    """Their chunks are written as they are published; the group's multis carry
    their manifests, and the names move as one."""
    with client_app(zk_url) as app:
        group([sig(app, [i, "x" * 400_000], "grp-chunked") for i in range(3)]).apply_async()
        items = stored(zk_client, "grp-chunked")
    assert [value[0] for value, _ in items] == list(range(3))
    assert [value[1] for value, _ in items] == ["x" * 400_000] * 3
    assert transactions(items) == 1


def test_a_bad_task_in_a_group_fails_clearly_and_the_earlier_ones_are_kept(
        zk_url: str, zk_client: KazooClient) -> None:
    """As when publishing task by task: what came before the error is stored."""
    with client_app(f"{zk_url}?max_message_size=1000000") as app:
        members = [sig(app, 0, "grp-bad"), sig(app, 1, "grp-bad"),
                   sig(app, "x" * 1_100_000, "grp-bad"), sig(app, 3, "grp-bad")]
        with pytest.raises(MessageTooLarge, match="Send a reference to the data"):
            group(members).apply_async()
        items = stored(zk_client, "grp-bad")
    assert [value for value, _ in items] == [0, 1]


def test_nested_groups_and_chains_are_stored_with_the_outer_group(
        zk_url: str, zk_client: KazooClient) -> None:
    with client_app(zk_url) as app:
        group(sig(app, 0, "grp-nest"),
              group(sig(app, 1, "grp-nest"), sig(app, 2, "grp-nest")),
              chain(sig(app, 3, "grp-nest"), sig(app, 4, "grp-nest"))).apply_async()
        items = stored(zk_client, "grp-nest")
    assert [value for value, _ in items] == [0, 1, 2, 3]   # 4 waits for 3
    # Celery's chain does not pass the group's producer on: its first task goes
    # through a pooled connection of its own, whose batch is stored right after.
    assert transactions(items) == 2


def test_a_lost_multi_reply_stores_nothing_twice(
        zk_url: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    with Connection(zk_url) as conn:
        transport = conn.transport
        store = transport.publisher
        client = transport.handle.client
        real_transaction = client.transaction
        lost: list[Any] = []

        def losing_transaction() -> Any:
            txn = real_transaction()
            real_commit = txn.commit

            def commit() -> Any:
                results = real_commit()
                if not lost:
                    lost.append(results)   # it committed; the reply goes missing
                    raise ConnectionLoss()
                return results
            txn.commit = commit
            return txn

        monkeypatch.setattr(client, "transaction", losing_transaction)
        messages = [store.new_message("lossy-grp", f'{{"body": "[[{i}]]"}}'.encode(), None)
                    for i in range(10)]
        names = store.put_batch(messages)
    assert lost
    assert all(names)
    assert [value for value, _ in stored(zk_client, "lossy-grp")] == list(range(10))


def test_a_bucket_deleted_before_the_multi_is_replaced(
        zk_url: str, zk_client: KazooClient) -> None:
    """A bucket emptied and deleted by consumers after the messages were named
    for it: they go to the queue's newest bucket instead."""
    with Connection(zk_url) as conn:
        store = conn.transport.publisher
        messages = [store.new_message("gone-grp", f'{{"body": "[[{i}]]"}}'.encode(), None)
                    for i in range(5)]
        for path in buckets(zk_client, LAYOUT, "gone-grp"):
            zk_client.delete(path)
        assert store.put_batch(messages)
    assert [value for value, _ in stored(zk_client, "gone-grp")] == list(range(5))


def test_a_chord_header_is_stored_together_and_the_chord_completes(
        zk_url: str, zk_client: KazooClient, start_worker: Any, task_log: Path) -> None:
    with client_app(zk_url, zk_url) as app:
        header = [app.signature("proj.app.add", args=(i, i), queue="grp-chord")
                  for i in range(40)]
        result = chord(header)(app.signature("proj.app.tsum", queue="grp-chord"))
        items = stored(zk_client, "grp-chord")
        assert len(items) == 40
        assert transactions(items) == 1
        start_worker(zk_url, backend=zk_url, log=task_log, queues="grp-chord",
                     pool="threads", concurrency=4)
        assert result.get(timeout=60) == sum(2 * i for i in range(40))


@pytest.mark.parametrize("first_import", ["from celery import group, Celery",
                                          "from celery import Celery, group",
                                          "import celery_zk\nfrom celery import Celery, group"])
def test_a_script_whose_first_publish_is_a_group_batches_it(
        zk_url: str, zk_client: KazooClient, first_import: str) -> None:
    """However the script's imports load Celery's canvas and celery_zk."""
    script = f"""{first_import}
app = Celery("script", broker={zk_url!r}, set_as_current=False)
group([app.signature("proj.app.record", args=(i,), queue="grp-script")
       for i in range(300)]).apply_async()
app.close()
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    items = stored(zk_client, "grp-script")
    assert [value for value, _ in items] == list(range(300))
    assert transactions(items) == 2


def test_a_group_given_as_a_generator_is_published_as_it_yields(
        zk_url: str, zk_client: KazooClient) -> None:
    """Celery publishes a generator's tasks as it yields them (celery#3021): they
    are never held back for the group's end, so each is stored (one create
    each) soon after the generator made it."""
    stored_before: list[int] = []
    with client_app(zk_url) as app:
        def members() -> Iterator[Any]:
            for i in range(6):
                stored_before.append(len(waiting(zk_client, LAYOUT, "grp-gen")))
                yield sig(app, i, "grp-gen")

        group(members()).apply_async()
        items = stored(zk_client, "grp-gen")
    assert [value for value, _ in items] == list(range(6))
    # Celery looks a task or two ahead (to know the last): when the generator
    # makes the sixth, at least three are stored (held, none would be).
    assert stored_before == sorted(stored_before) and stored_before[-1] >= 3, stored_before
    assert transactions(items) == 6
