"""Results bigger than one znode (issue 28): stored in chunks, read whole, deleted
with their done node, collected when orphaned. Real ZooKeeper, and real workers
for the end-to-end shapes."""
from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery, chord, group, states
from celery.result import ResultSet
from kazoo.client import KazooClient

import celery_zk.backend.payloads as backend_payloads
from celery_zk.backend import ZooKeeperBackend
from celery_zk.backend.expiry import HOUR, RESULT, Key
from celery_zk.exceptions import PayloadError, ResultTooLarge
from celery_zk.ops.exporter import StatusCollector
from celery_zk.ops.report import format_status
from celery_zk.ops.status import collect
from celery_zk.zk.layout import Layout
from celery_zk.zk.payload import is_manifest, parse_manifest

from .big import text, wipe  # noqa: F401  (wipe: an autouse fixture)
from .workers import Worker

TASK = "proj.app."
MB = 1_000_000
CHUNK = 128 * 1024   # the default chunk_size


@pytest.fixture
def app(zk_url: str) -> Iterator[Celery]:
    client_app = Celery("big", broker=zk_url, backend=zk_url, set_as_current=False)
    client_app.conf.update(broker_connection_retry_on_startup=True, result_expires=24 * HOUR)
    yield client_app
    client_app.backend.close()
    client_app.close()


@pytest.fixture
def backend(app: Celery) -> ZooKeeperBackend:
    b = app.backend
    assert isinstance(b, ZooKeeperBackend)
    return b


def send(app: Celery, name: str, *args: Any) -> Any:
    return app.send_task(TASK + name, args)


def pattern(size: int, seed: int) -> str:
    """What proj.app.pattern_text returns."""
    line = f"part {seed}: " + "abcdefgh" * 120 + "\n"
    return (line * (size // len(line) + 1))[:size]


def containers(backend: ZooKeeperBackend) -> list[str]:
    """Every payload container under the backend's root."""
    client, layout = backend.client, backend.layout
    if client.exists(layout.payloads) is None:
        return []
    return sorted(layout.listed(layout.listed(layout.payloads, shard), name)
                  for shard in client.get_children(layout.payloads)
                  for name in client.get_children(layout.listed(layout.payloads, shard)))


def payload_entries(backend: ZooKeeperBackend) -> list[str]:
    client, layout = backend.client, backend.layout
    if client.exists(layout.expiry) is None:
        return []
    found = []
    for hour in client.get_children(layout.expiry):
        bucket = layout.listed(layout.expiry, hour)
        for shard in client.get_children(bucket):
            found += [name for name in client.get_children(layout.listed(bucket, shard))
                      if layout.parse_payload_entry(name)]
    return found


# -- the backend in-process ---------------------------------------------------------------
def test_a_big_result_is_stored_in_chunks_and_read_whole(app: Celery,
                                                         backend: ZooKeeperBackend) -> None:
    value = text(3 * MB)
    backend.store_result("big", value, states.SUCCESS)
    data, _ = backend.client.get(backend.result_path("big"))
    assert is_manifest(data) and len(data) < 200   # the done node holds the manifest
    manifest = parse_manifest(data)
    assert manifest.chunks == -(-manifest.size // CHUNK) == 23
    [container] = containers(backend)
    assert len(backend.client.get_children(container)) == manifest.chunks
    assert len(payload_entries(backend)) == 1
    assert app.AsyncResult("big").get(timeout=10) == value
    assert backend.get_task_meta("big", cache=False)["result"] == value
    assert backend.decode_result(backend.mget([Key(RESULT, "big")])[0])["result"] == value
    assert dict(backend.get_many(["big"], timeout=5))["big"]["result"] == value


def test_a_plain_done_node_of_the_previous_format_still_reads(
        app: Celery, backend: ZooKeeperBackend) -> None:
    meta = {"status": "SUCCESS", "result": [1, "two"], "traceback": None, "children": [],
            "date_done": "2025-01-01T00:00:00", "task_id": "old"}
    backend.client.create(backend.result_path("old"), json.dumps(meta).encode(),
                          makepath=True)
    assert app.AsyncResult("old").get(timeout=5) == [1, "two"]
    assert backend.decode_result(backend.mget([Key(RESULT, "old")])[0])["result"] == [1, "two"]


def test_a_waiter_reads_the_chunks_in_its_own_thread(
        app: Celery, backend: ZooKeeperBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Woken by the watch, the chunks are read by the waiting thread, never from a
    kazoo callback (docs/design.md, Watch callbacks)."""
    threads: list[str] = []
    real = backend_payloads.read_payloads

    def spying(client: KazooClient, items: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(client, items)

    monkeypatch.setattr(backend_payloads, "read_payloads", spying)
    value = text(2 * MB, seed=1)
    result = app.AsyncResult("later")
    timer = threading.Timer(1.0, backend.store_result, ("later", value, states.SUCCESS))
    timer.start()
    assert result.get(timeout=10) == value
    timer.join()
    assert threads == [threading.current_thread().name]


def test_a_rewrite_replaces_the_chunks_in_one_multi(app: Celery,
                                                    backend: ZooKeeperBackend) -> None:
    backend.store_result("steps", text(CHUNK + 1, seed=1), states.STARTED)
    [first] = containers(backend)
    backend.store_result("steps", text(CHUNK * 2, seed=2), states.RETRY)
    [second] = containers(backend)
    assert second != first   # a new container per write, the old one gone
    backend.store_result("steps", "small", states.SUCCESS)
    assert containers(backend) == []
    assert app.AsyncResult("steps").get(timeout=5) == "small"
    # A stored SUCCESS is never replaced: the late write's chunks are dropped.
    backend.store_result("done", text(CHUNK * 2, seed=3), states.SUCCESS)
    [kept] = containers(backend)
    backend.store_result("done", text(CHUNK * 3, seed=4), states.FAILURE)
    assert containers(backend) == [kept]
    assert backend.get_task_meta("done", cache=False)["result"] == text(CHUNK * 2, seed=3)


def test_a_reader_whose_chunks_vanish_reads_the_new_value(backend: ZooKeeperBackend) -> None:
    backend.store_result("moving", text(CHUNK * 2, seed=1), states.STARTED)
    key = backend.get_key_for_task("moving")
    old, _ = backend.client.get(backend.result_path("moving"))
    backend.store_result("moving", text(CHUNK * 2, seed=2), states.SUCCESS)
    # The old manifest's chunks are gone: the read takes what is there now.
    [value] = backend.payloads.resolve([key], [old])
    assert value is not None
    assert backend.decode_result(value)["result"] == text(CHUNK * 2, seed=2)
    backend.forget("moving")
    assert backend.payloads.resolve([key], [old]) == [None]


def test_a_broken_result_is_a_clear_error_for_its_waiter_alone(
        app: Celery, backend: ZooKeeperBackend) -> None:
    backend.store_result("broken", text(CHUNK * 2), states.SUCCESS)
    backend.store_result("fine", text(CHUNK * 2, seed=1), states.SUCCESS)
    [container] = [c for c in containers(backend) if "/r~broken~" in c]
    backend.client.delete(Layout.chunk(container, 1))   # by hand
    both = ResultSet([app.AsyncResult("broken"), app.AsyncResult("fine")], app=app)
    with pytest.raises(PayloadError, match=f"{Layout.chunk(container, 1)} is missing"):
        both.get(timeout=10)
    assert app.AsyncResult("fine").get(timeout=10) == text(CHUNK * 2, seed=1)
    got = dict(backend.get_many(["broken", "fine"], timeout=10))
    assert got["broken"]["status"] == states.FAILURE
    with pytest.raises(PayloadError, match="cannot be read.*forget()"):
        backend.mget([Key(RESULT, "broken")])
    app.AsyncResult("broken").forget()   # the way out the error names
    assert [c for c in containers(backend) if "/r~broken~" in c] == []


def test_forget_deletes_the_chunks_with_the_done_node(app: Celery,
                                                      backend: ZooKeeperBackend) -> None:
    backend.store_result("gone", text(2 * MB), states.SUCCESS)
    assert len(containers(backend)) == 1
    app.AsyncResult("gone").forget()
    assert backend.client.exists(backend.result_path("gone")) is None
    assert containers(backend) == []
    assert app.AsyncResult("gone").state == states.PENDING


def test_a_big_saved_group_is_chunked_too(app: Celery, zk_url: str) -> None:
    small = Celery("small-chunks", backend=zk_url + "?chunk_size=1024", set_as_current=False)
    try:
        ids = [f"task-{i:05d}" for i in range(200)]
        saved = small.GroupResult("g1", [small.AsyncResult(i) for i in ids])
        saved.save()
        assert len(containers(small.backend)) == 1
        restored = small.GroupResult.restore("g1", app=small)
        assert restored is not None and [r.id for r in restored.results] == ids
        saved.delete()
        assert containers(small.backend) == []
    finally:
        small.backend.close()


def test_expiry_deletes_chunks_with_their_results(backend: ZooKeeperBackend) -> None:
    backend.store_result("old-big", text(2 * MB), states.SUCCESS)
    backend.store_result("old-small", 1, states.SUCCESS)
    now = time.time()
    backend.clock = lambda: now + 5 * HOUR
    backend.store_result("new-big", text(2 * MB, seed=5), states.SUCCESS)
    backend.clock = lambda: now + 26 * HOUR
    backend.cleanup()
    assert backend.client.exists(backend.result_path("old-big")) is None
    assert backend.client.exists(backend.result_path("old-small")) is None
    [left] = containers(backend)
    assert Layout.parent(left).startswith(backend.layout.payloads)
    assert "/r~new-big~" in left
    backend.clock = lambda: now + 40 * HOUR
    backend.cleanup()
    assert containers(backend) == [] and payload_entries(backend) == []


def test_orphans_are_collected_and_live_chunks_kept(
        backend: ZooKeeperBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container whose done node was written in a later hour is kept until that
    hour expires; one no done node points at (its writer died) is collected."""
    now = time.time()
    # The server stamps nodes with its own clock: the containers are indexed 3
    # hours back, the done node is written now.
    backend.clock = lambda: now - 3 * HOUR
    # Chunks, and then the writer died: no done node.
    backend.payloads.store(backend.get_key_for_task("orphan"), b"x" * (2 * CHUNK),
                           int((now - 3 * HOUR) // HOUR))
    real = backend_payloads.write_chunks

    def slow(*args: Any, **kwargs: Any) -> bytes:   # the done node, hours later
        manifest = real(*args, **kwargs)
        backend.clock = lambda: now
        return manifest

    monkeypatch.setattr(backend_payloads, "write_chunks", slow)
    backend.store_result("late", text(CHUNK * 2), states.SUCCESS)
    [_, kept] = sorted(containers(backend), key=lambda c: "/r~late~" in c)
    assert "/r~late~" in kept and len(payload_entries(backend)) == 3   # 2 hours for "late"
    backend.clock = lambda: now + 22 * HOUR   # the containers' hour expired, not the node's
    backend.cleanup()
    assert containers(backend) == [kept]
    assert backend.get_task_meta("late", cache=False)["result"] == text(CHUNK * 2)
    backend.clock = lambda: now + 26 * HOUR
    backend.cleanup()
    assert containers(backend) == [] and payload_entries(backend) == []
    assert backend.client.exists(backend.result_path("late")) is None


def test_the_size_limit_is_a_clear_error(backend: ZooKeeperBackend) -> None:
    with pytest.raises(ResultTooLarge) as excinfo:
        backend.store_result("huge", "x" * (16 * 1024 * 1024 + 1), states.SUCCESS)
    message = str(excinfo.value)
    assert "huge" in message and "16,777,216" in message and "max_result_size" in message
    assert containers(backend) == []


def test_status_and_the_exporter_count_chunked_results_from_names(
        backend: ZooKeeperBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    backend.store_result("a", text(3 * MB), states.SUCCESS)
    backend.store_result("b", text(CHUNK + 1, seed=1), states.SUCCESS)
    backend.store_result("c", "small", states.SUCCESS)
    sizes = [len(backend.client.get(backend.result_path(t))[0]) for t in "abc"]
    real_get = backend.client.get_async
    reads: list[str] = []
    monkeypatch.setattr(backend.client, "get_async",
                        lambda path, *a, **k: reads.append(path) or real_get(path, *a, **k))
    status = collect(backend.client, backend.layout, backend.settings.hosts,
                     results_layout=backend.layout, queues=[], health=False)
    assert reads == []   # names and stats only: no data read
    assert status.results is not None
    assert status.results.results == 3
    assert status.results.chunked == 2
    manifests = [parse_manifest(backend.client.get(backend.result_path(t))[0]) for t in "ab"]
    assert status.results.chunked_bytes == sum(m.size for m in manifests) > 3 * MB
    assert sizes[2] < 200 and all(size < 200 for size in sizes[:2])
    assert "2 stored in chunks (3." in format_status(status, "zk://x")
    metrics = {sample.name: sample.value for family in StatusCollector(lambda: status).collect()
               for sample in family.samples}
    assert metrics["celery_zk_results_chunked"] == 2
    assert metrics["celery_zk_results_chunked_bytes"] == status.results.chunked_bytes


# -- real workers ------------------------------------------------------------------------
@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_3_and_15_mb_results_through_workers(app: Celery, worker: Callable[..., Worker],
                                              pool: str) -> None:
    worker(pool=pool, concurrency=2)
    results = [send(app, "big_text", 3 * MB, 3), send(app, "big_text", 15 * MB, 15),
               send(app, "add", 2, 3)]
    assert results[2].get(timeout=60) == 5
    assert results[0].get(timeout=60) == text(3 * MB, 3)
    assert results[1].get(timeout=60) == text(15 * MB, 15)
    assert app.AsyncResult(results[1].id).get(timeout=10) == text(15 * MB, 15)   # again


def test_a_chord_whose_parts_return_2_mb_each(app: Celery,
                                              worker: Callable[..., Worker]) -> None:
    """The last part reads every header result (chunked) and sends them to the
    body. The body's message carries all of them: gzipped here, because message
    bodies above max_message_size wait for the broker's half of issue 28."""
    worker(concurrency=4, conf={"task_compression": "gzip"})
    header = [app.signature(TASK + "pattern_text", (2 * MB, i)) for i in range(4)]
    result = chord(header)(app.signature(TASK + "digests"))
    expected = [[2 * MB, hashlib.sha256(pattern(2 * MB, i).encode()).hexdigest()]
                for i in range(4)]
    assert result.get(timeout=120) == expected
    parts = result.parent.get(timeout=30)
    assert [hashlib.sha256(p.encode()).hexdigest() for p in parts] == [e[1] for e in expected]


def test_a_result_past_the_limit_fails_and_the_worker_goes_on(
        app: Celery, worker: Callable[..., Worker]) -> None:
    w = worker()
    big = send(app, "huge_result", 16 * 1024 * 1024 + 1)
    with pytest.raises(ResultTooLarge) as excinfo:
        big.get(timeout=60)
    message = str(excinfo.value)
    assert big.id in message and "16,777,216" in message and "max_result_size" in message
    assert send(app, "add", 1, 1).get(timeout=30) == 2
    assert w.proc is not None and w.proc.poll() is None
    assert containers(app.backend) == []


def test_a_worker_killed_between_chunks_leaves_nothing_for_good(
        app: Celery, backend: ZooKeeperBackend, worker: Callable[..., Worker]) -> None:
    w = worker(env={"CELERY_ZK_TEST_DIE_AT_CHUNK": "3"})
    result = send(app, "big_text", 3 * MB)
    assert w.proc is not None
    w.proc.wait(60)   # SIGKILLed by its own hook, three chunks in
    [orphan] = containers(backend)
    assert 1 <= len(backend.client.get_children(orphan)) <= 3
    assert backend.client.exists(backend.result_path(result.id)) is None
    assert len(payload_entries(backend)) == 1   # indexed before its first chunk
    backend.clock = lambda: time.time() + 26 * HOUR
    backend.cleanup()
    assert containers(backend) == [] and payload_entries(backend) == []
    # The next worker stores big results as usual.
    worker(name="w2")
    assert send(app, "big_text", CHUNK + 1, 9).get(timeout=60) == text(CHUNK + 1, 9)


def test_a_chord_of_big_parts_on_prefork(app: Celery, worker: Callable[..., Worker]) -> None:
    worker(pool="prefork", concurrency=2, conf={"task_compression": "gzip"})
    result = chord(app.signature(TASK + "pattern_text", (CHUNK * 3, i))
                   for i in range(3))(app.signature(TASK + "digests"))
    assert [length for length, _ in result.get(timeout=120)] == [CHUNK * 3] * 3
    big_group = group(app.signature(TASK + "big_text", (MB, i)) for i in range(3))()
    assert big_group.get(timeout=60) == [text(MB, i) for i in range(3)]
