"""multiRead on a real ZooKeeper: many bodies in one request, each read on its own."""
from __future__ import annotations

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kombu import Connection

from celery_zk.zk import reads
from celery_zk.zk.reads import MAX_READS, read_many


def test_many_reads_come_back_in_order_each_with_its_own_outcome(zk_client: KazooClient) -> None:
    """A chrooted client: the paths are the chroot's. A missing node fails its
    own read only (multiRead is not atomic), empty data reads as b""."""
    zk_client.ensure_path("/r")
    paths = []
    for i in range(MAX_READS + 5):   # two requests
        path = f"/r/n{i:03d}"
        zk_client.create(path, b"" if i == 3 else f"body {i}".encode() * 50)
        paths.append(path)
    paths.insert(7, "/r/missing")
    slots = read_many(zk_client, paths)
    assert len(slots) == len(paths)
    for path, slot in zip(paths, slots):
        if path == "/r/missing":
            try:
                slot.get()
            except NoNodeError:
                continue
            raise AssertionError("a missing node's read did not fail")
        data, stat = slot.get()
        assert slot.ready()
        assert (data, stat) == zk_client.get(path)


def test_a_consumer_reads_what_it_was_given_in_few_requests(
        zk_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The inbox reads its arrivals' bodies with multiRead (a server of 3.6 or
    newer, known from its persistent watch): no getData of a body of its own."""
    with Connection(zk_url) as conn:
        queue = conn.SimpleQueue("many")
        for i in range(20):
            queue.put({"n": i})
        client = conn.transport.handle.client
        single: list[str] = []
        batches: list[int] = []
        for name in ("get", "get_async"):
            real = getattr(client, name)
            monkeypatch.setattr(client, name, lambda path, *a, __real=real, **k: (
                single.append(path), __real(path, *a, **k))[1])
        real_send = reads.kazoo_compat.send

        def send(c: KazooClient, request: object) -> object:
            if isinstance(request, reads.MultiRead):   # not addWatch, sent the same way
                batches.append(len(request.paths))
            return real_send(c, request)
        monkeypatch.setattr(reads.kazoo_compat, "send", send)
        got = [queue.get(timeout=10) for _ in range(20)]
        for message in got:
            message.ack()
        assert [m.payload["n"] for m in got] == list(range(20))
        assert sum(batches) == 20 and len(batches) < 20
        assert not [path for path in single if "/bodies/" in path]
