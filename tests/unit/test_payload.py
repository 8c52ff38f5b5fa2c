"""The pure parts of chunked payloads: the manifest, names, limits."""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
import pickle
import zlib

import pytest
from kombu.exceptions import SerializerNotInstalled
from kombu.serialization import dumps

from celery_zk.exceptions import PayloadError, ZKConfigurationError
from celery_zk.zk.config import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, parse_url
from celery_zk.zk.layout import Layout
from celery_zk.zk.names import chunk_name, parse_payload_name, payload_name
from celery_zk.zk.payload import (
    MAGIC,
    Manifest,
    check_chunk_size,
    chunk_paths,
    is_manifest,
    needs_chunks,
    parse_manifest,
)


def test_a_manifest_round_trips_and_is_small() -> None:
    manifest = Manifest(chunks=32, size=16 * 1024 * 1024, sha256="ab" * 32, ref="0123abcd")
    data = manifest.encode()
    assert is_manifest(data) and data.startswith(MAGIC)
    assert parse_manifest(data) == manifest
    assert len(data) < 200


@pytest.mark.parametrize("data", [
    MAGIC + b"not json",
    MAGIC + b"[]",
    MAGIC + json.dumps({"v": 2, "count": 1, "size": 1, "sha256": "x"}).encode(),
    MAGIC + json.dumps({"v": 1, "count": 0, "size": 1, "sha256": "x"}).encode(),
    MAGIC + json.dumps({"v": 1, "size": 1, "sha256": "x"}).encode(),
    b'{"status": "SUCCESS"}',
])
def test_a_broken_manifest_is_a_clear_error_naming_the_node(data: bytes) -> None:
    with pytest.raises(PayloadError, match="/app/results/ab/t1 does not hold a valid chunk"):
        parse_manifest(data, "/app/results/ab/t1")


def test_nothing_celery_encodes_starts_like_a_manifest() -> None:
    meta = {"status": "SUCCESS", "result": "\0" * 10, "task_id": "t"}
    encoded = []
    for name in ("json", "pickle", "yaml"):
        try:
            encoded.append(dumps(meta, serializer=name)[2])
        except SerializerNotInstalled:   # yaml needs PyYAML, which Celery does not pull
            assert name == "yaml"
    encoded += [pickle.dumps(meta, protocol=p) for p in range(2, pickle.HIGHEST_PROTOCOL + 1)]
    encoded += [zlib.compress(b"x"), bz2.compress(b"x"), gzip.compress(b"x"),
                lzma.compress(b"x")]
    try:
        import msgpack
    except ImportError:
        pass
    else:
        encoded.append(msgpack.packb(meta))
    for data in encoded:
        data = data.encode() if isinstance(data, str) else data
        assert not is_manifest(data), data[:20]
        assert not needs_chunks(data, 1024 * 1024)


def test_what_needs_chunks() -> None:
    assert not needs_chunks(b"x" * 1024, 1024)
    assert needs_chunks(b"x" * 1025, 1024)
    # Small, but it would read as a manifest: stored chunked so it reads back as itself.
    assert needs_chunks(MAGIC + b"tiny", 1024)
    assert not is_manifest("text is never a manifest")
    assert not is_manifest(None)


def test_chunk_names_sort_in_order_and_are_bounded() -> None:
    names = [chunk_name(i) for i in (0, 1, 9, 10, 999_999)]
    assert names == sorted(names) == ["c000000", "c000001", "c000009", "c000010", "c999999"]
    with pytest.raises(ValueError):
        chunk_name(1_000_000)


def test_chunk_paths_end_with_the_container() -> None:
    manifest = Manifest(3, 2500, "00", "tok")
    assert chunk_paths("/a/b", manifest) == ["/a/b/c000000", "/a/b/c000001", "/a/b/c000002",
                                             "/a/b"]
    assert chunk_paths("/a/b", manifest.encode()) == chunk_paths("/a/b", manifest)


@pytest.mark.parametrize("task_id", ["plain-uuid", "a~b/c%d", "", "x" * 200])
def test_payload_names_and_index_entries_parse_back(task_id: str) -> None:
    layout = Layout("/app")
    name = payload_name("r", task_id, "0123456789abcdef", 3_000_000)
    assert "/" not in name
    assert parse_payload_name(name) == ("r", task_id, "0123456789abcdef", 3_000_000)
    container = layout.payload("r", task_id, "0123456789abcdef", 3_000_000)
    assert layout.parent(layout.parent(container)) == layout.payloads
    # The index entry sits in the shard of the result's own entry, and parses back.
    entry = layout.payload_entry(7, "r", task_id, "0123456789abcdef", 3_000_000)
    assert layout.parent(entry) == layout.parent(layout.expiry_entry(7, "r", task_id))
    parsed = layout.parse_payload_entry(entry.rpartition("/")[2])
    assert parsed == ("r", task_id, "0123456789abcdef", 3_000_000)
    assert layout.parse_payload_entry("r~" + task_id) is None
    assert layout.chunk(container, 2) == container + "/c000002"


def test_chunk_size_bounds() -> None:
    check_chunk_size(MIN_CHUNK_SIZE)
    check_chunk_size(MAX_CHUNK_SIZE)
    for bad in (MIN_CHUNK_SIZE - 1, MAX_CHUNK_SIZE + 1):
        with pytest.raises(ValueError, match="jute.maxbuffer"):
            check_chunk_size(bad)


def test_payload_options_defaults_and_validation() -> None:
    options = parse_url("zk://h/app").options
    assert options.chunk_size == 128 * 1024
    assert options.max_result_size == 16 * 1024 * 1024
    assert parse_url("zk://h/app?chunk_size=4096&max_result_size=10").options.chunk_size == 4096
    with pytest.raises(ZKConfigurationError, match="'chunk_size' must be between"):
        parse_url("zk://h/app?chunk_size=2000000")
    with pytest.raises(ZKConfigurationError, match="'max_result_size' must be at least 1"):
        parse_url("zk://h/app?max_result_size=0")
    with pytest.raises(ZKConfigurationError, match="raise chunk_size or lower max_result_size"):
        parse_url("zk://h/app", {"chunk_size": 1024, "max_result_size": 2 * 1024 ** 3})
