"""celery_zk.zk.payload against a real ZooKeeper (default jute.maxbuffer: 1 MiB)."""
from __future__ import annotations

import os
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss

from celery_zk.exceptions import ChunkMissing, PayloadError
from celery_zk.zk import payload
from celery_zk.zk.layout import Layout
from celery_zk.zk.payload import (
    IN_FLIGHT_BYTES,
    MULTI_DELETES,
    chunk_paths,
    commit_deleting,
    delete_container,
    parse_manifest,
    read_payload,
    read_payloads,
    write_chunks,
)

CHUNK = 64 * 1024


@pytest.fixture
def container(zk_client: KazooClient) -> str:
    zk_client.ensure_path("/payloads/one")
    return "/payloads/one"


@pytest.mark.parametrize("size", [1, CHUNK, CHUNK + 1, 3 * 1024 * 1024 + 7])
def test_a_payload_reads_back_whole(zk_client: KazooClient, container: str, size: int) -> None:
    data = os.urandom(size)
    manifest = write_chunks(zk_client, container, data, CHUNK, ref="r1")
    parsed = parse_manifest(manifest)
    assert parsed.size == size and parsed.ref == "r1"
    assert parsed.chunks == max(1, -(-size // CHUNK))
    assert sorted(zk_client.get_children(container)) == [
        p.rpartition("/")[2] for p in chunk_paths(container, manifest)[:-1]]
    assert read_payload(zk_client, container, manifest) == data
    # Data that is not a manifest is the payload itself.
    assert read_payload(zk_client, container, b'{"plain": 1}') == b'{"plain": 1}'


def test_chunks_bigger_than_jute_maxbuffer_would_be_refused(zk_client: KazooClient,
                                                            container: str) -> None:
    """One request per chunk keeps every request below the server's 1 MiB: a
    16 MiB payload in 512 KiB chunks goes through a default server (the default
    chunk_size is smaller: see docs/sizing.md)."""
    data = os.urandom(16 * 1024 * 1024)
    manifest = write_chunks(zk_client, container, data, 512 * 1024)
    assert parse_manifest(manifest).chunks == 32
    assert read_payload(zk_client, container, manifest) == data


def test_requests_are_pipelined_and_bounded(zk_client: KazooClient, container: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[Any] = []
    most = [0]
    real_create, real_get = zk_client.create_async, zk_client.get_async

    def track(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            sent.append(result)
            most[0] = max(most[0], sum(1 for r in sent if not r.ready()))
            return result
        return call

    monkeypatch.setattr(zk_client, "create_async", track(real_create))
    monkeypatch.setattr(zk_client, "get_async", track(real_get))
    data = os.urandom(100 * CHUNK)   # more than IN_FLIGHT_BYTES
    manifest = write_chunks(zk_client, container, data, CHUNK)
    assert 1 < most[0] <= IN_FLIGHT_BYTES // CHUNK
    most[0] = 0
    assert read_payload(zk_client, container, manifest) == data
    assert 1 < most[0] <= IN_FLIGHT_BYTES // CHUNK


def test_writing_again_after_a_lost_reply_is_success(zk_client: KazooClient, container: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(5 * CHUNK)
    real = zk_client.create_async
    calls = [0]

    def lose_the_third_reply(path: str, value: bytes = b"", **kwargs: Any) -> Any:
        calls[0] += 1
        made = real(path, value, **kwargs)
        if calls[0] != 3:
            return made
        made.get()   # the node is made; its reply is lost
        lost = zk_client.handler.async_result()
        lost.set_exception(ConnectionLoss())
        return lost

    monkeypatch.setattr(zk_client, "create_async", lose_the_third_reply)
    manifest = write_chunks(zk_client, container, data, CHUNK)
    assert calls[0] > 5   # the lost one was sent again and found made
    assert read_payload(zk_client, container, manifest) == data
    # And a whole write repeated with the same container and bytes, too.
    assert write_chunks(zk_client, container, data, CHUNK) == manifest


def test_a_container_holding_other_bytes_is_refused(zk_client: KazooClient,
                                                    container: str) -> None:
    write_chunks(zk_client, container, b"a" * (2 * CHUNK), CHUNK)
    with pytest.raises(PayloadError, match=f"{container}/c000000 already holds other bytes"):
        write_chunks(zk_client, container, b"b" * (2 * CHUNK), CHUNK)


def test_a_missing_container_is_a_clear_error(zk_client: KazooClient) -> None:
    with pytest.raises(PayloadError, match="/nowhere does not exist: make the container"):
        write_chunks(zk_client, "/nowhere", b"x" * 10, CHUNK)


def test_a_missing_or_changed_chunk_is_named(zk_client: KazooClient, container: str) -> None:
    data = os.urandom(3 * CHUNK)
    manifest = write_chunks(zk_client, container, data, CHUNK)
    zk_client.set(Layout.chunk(container, 1), b"y" * CHUNK)
    with pytest.raises(PayloadError, match="do not match their manifest's sha256"):
        read_payload(zk_client, container, manifest)
    zk_client.set(Layout.chunk(container, 1), b"y")
    with pytest.raises(PayloadError, match="hold 131,073 bytes; their manifest says 196,608"):
        read_payload(zk_client, container, manifest)
    zk_client.delete(Layout.chunk(container, 1))
    with pytest.raises(ChunkMissing, match="chunk 2 of 3 of the 196,608-byte payload") as info:
        read_payload(zk_client, container, manifest)
    assert info.value.path == Layout.chunk(container, 1)


def test_many_payloads_are_read_in_one_pipeline(zk_client: KazooClient) -> None:
    items = []
    for i in range(5):
        path = f"/payloads/p{i}"
        zk_client.ensure_path(path)
        data = os.urandom(CHUNK * i + 10)
        items.append((path, write_chunks(zk_client, path, data, CHUNK), data))
    items.append(("/payloads/none", b"plain", b"plain"))
    got = read_payloads(zk_client, [(path, manifest) for path, manifest, _ in items])
    assert got == [data for _, _, data in items]


def test_the_visible_node_and_its_chunks_go_in_one_multi(zk_client: KazooClient,
                                                         container: str) -> None:
    manifest = write_chunks(zk_client, container, os.urandom(3 * CHUNK), CHUNK)
    zk_client.create("/visible", manifest)
    commits = []
    real = zk_client.transaction

    def counting() -> Any:
        tx = real()
        commits.append(tx)
        return tx

    zk_client.transaction = counting  # type: ignore[method-assign]
    try:
        failure = commit_deleting(zk_client, lambda tx: tx.delete("/visible"),
                                  chunk_paths(container, manifest))
    finally:
        zk_client.transaction = real  # type: ignore[method-assign]
    assert failure is None and len(commits) == 1
    assert len(commits[0].operations) == 1 + 3 + 1   # the node, the chunks, the container
    assert zk_client.exists("/visible") is None and zk_client.exists(container) is None


def test_chunks_gone_already_do_not_block_the_change(zk_client: KazooClient,
                                                     container: str) -> None:
    manifest = write_chunks(zk_client, container, os.urandom(3 * CHUNK), CHUNK)
    zk_client.create("/visible", manifest)
    zk_client.delete(Layout.chunk(container, 2))
    failure = commit_deleting(zk_client, lambda tx: tx.set_data("/visible", b"new"),
                              chunk_paths(container, manifest))
    assert failure is None
    assert zk_client.get("/visible")[0] == b"new" and zk_client.exists(container) is None
    # A failure of the caller's own ops is reported, and nothing is deleted.
    zk_client.ensure_path("/other")
    manifest = write_chunks(zk_client, "/other", b"z" * 10, CHUNK)
    failure = commit_deleting(zk_client, lambda tx: tx.delete("/visible", version=99),
                              chunk_paths("/other", manifest))
    assert failure is not None and failure[0] == 0
    assert zk_client.exists(Layout.chunk("/other", 0)) is not None


def test_more_chunks_than_one_multi_takes(zk_client: KazooClient, container: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payload, "MULTI_DELETES", 3)
    assert MULTI_DELETES == 1000   # the real bound, far above 16 MiB / 128 KiB
    manifest = write_chunks(zk_client, container, os.urandom(7 * 1024), 1024)
    zk_client.create("/visible", manifest)
    assert commit_deleting(zk_client, lambda tx: tx.delete("/visible"),
                           chunk_paths(container, manifest)) is None
    assert zk_client.exists("/visible") is None and zk_client.exists(container) is None


def test_an_orphan_is_deleted_whatever_it_holds(zk_client: KazooClient,
                                                container: str) -> None:
    write_chunks(zk_client, container, os.urandom(3 * CHUNK), CHUNK)
    zk_client.delete(Layout.chunk(container, 0))   # as if its writer died mid-way
    delete_container(zk_client, container)
    assert zk_client.exists(container) is None
    delete_container(zk_client, container)   # gone already: nothing to do
