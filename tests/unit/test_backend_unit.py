"""Pure logic of the zk:// result backend: no ZooKeeper needed (clients start lazily)."""
from __future__ import annotations

import pickle
from collections import Counter

import pytest
from celery import Celery
from kombu.exceptions import EncodeError

from celery_zk.backend import ZooKeeperBackend
from celery_zk.backend.expiry import HOUR, RESULT, Key, bucket_expired, expiry_hour
from celery_zk.exceptions import MessageTooLarge, ResultTooLarge
from celery_zk.zk.layout import Layout
from celery_zk.zk.names import result_shard


def make_backend(url: str = "zk://h1:2181,h2:2182/myapp", **conf: object) -> ZooKeeperBackend:
    app = Celery("unit", backend=url, set_as_current=False)
    app.conf.update(conf)
    backend = app.backend
    assert isinstance(backend, ZooKeeperBackend)
    return backend


def test_zk_scheme_resolves_to_the_backend_with_every_host() -> None:
    backend = make_backend("zk://u:secret@h1:2181,h2:2182/myapp?session_timeout=3",
                           result_backend_transport_options={"max_result_size": 5000,
                                                             "chunk_size": 2048})
    assert backend.settings.hosts == "h1:2181,h2:2182"
    assert backend.settings.root == "/myapp"
    assert backend.settings.options.session_timeout == 3
    assert backend.max_size == 5000
    assert backend.chunk_size == 2048
    assert "secret" not in repr(backend) and "secret" not in backend.as_uri()
    assert "secret" in backend.as_uri(include_password=True)
    assert not backend._handle.started  # nothing connects until a result is used


def test_pickled_backend_keeps_its_url() -> None:
    backend = make_backend("zk://h1:2181/app?max_message_size=1234")
    clone = pickle.loads(pickle.dumps(backend))
    assert clone.url == backend.url
    assert clone.settings == backend.settings
    assert clone.expires == backend.expires


def test_keys_map_to_the_layout() -> None:
    backend = make_backend()
    layout = Layout("/myapp")
    assert backend.get_key_for_task("t1") == Key(RESULT, "t1")
    assert backend.path(backend.get_key_for_task("t1")) == layout.result("t1")
    assert backend.path(backend.get_key_for_group("g1")) == layout.group("g1")
    assert backend.path(backend.get_key_for_chord("g1")) == layout.chord("g1")
    assert backend.result_path("t1") == f"/myapp/results/{result_shard('t1')}/t1"
    with pytest.raises(ValueError):
        backend.get_key_for_task("")


def test_done_area_shards_stay_small_for_a_million_results() -> None:
    counts = Counter(result_shard(f"{i:08x}-task") for i in range(1_000_000))
    assert len(counts) == 256
    assert max(counts.values()) < 10_000


def test_expiry_entries_are_sharded_and_parse_back() -> None:
    layout = Layout("/app")
    entry = layout.expiry_entry(12, RESULT, "a/b~c")
    bucket, shard, name = entry.rsplit("/", 2)
    assert bucket == layout.expiry_bucket(12) == "/app/expiry/h0000000012"
    assert shard == result_shard("a/b~c")
    assert layout.parse_expiry_entry(name) == (RESULT, "a/b~c")
    assert layout.parse_expiry_bucket("h0000000012") == 12


def test_expiry_bucket_math() -> None:
    assert expiry_hour(0) == 0
    assert expiry_hour(HOUR - 0.001) == 0
    assert expiry_hour(HOUR) == 1
    # A bucket expires only once its *last* second is older than the cutoff.
    assert not bucket_expired(5, cutoff=5 * HOUR + HOUR - 1)
    assert bucket_expired(5, cutoff=6 * HOUR)
    assert bucket_expired(5, cutoff=100 * HOUR)


def test_size_limit_error_names_the_limit() -> None:
    backend = make_backend(result_backend_transport_options={"max_result_size": 100})
    backend.check_size("t-1", b"x" * 100)  # at the limit: fine
    with pytest.raises(ResultTooLarge) as excinfo:
        backend.check_size("t-1", b"x" * 101)
    message = str(excinfo.value)
    assert "t-1" in message and "101 bytes" in message and "limit of 100" in message
    assert "max_result_size" in message and "reference" in message
    # Celery's tracer turns an EncodeError into a failed task, not a crash.
    assert isinstance(excinfo.value, EncodeError)
    assert isinstance(excinfo.value, MessageTooLarge)


def test_encoded_meta_round_trips() -> None:
    backend = make_backend()
    meta = backend._get_result_meta({"a": [1, 2]}, "SUCCESS", None, None)
    meta["task_id"] = "t"
    data = backend.encode(meta)
    assert backend.decode_result(data)["result"] == {"a": [1, 2]}
    key = Key(RESULT, "t")
    assert backend._is_success(key, data)
    assert not backend._is_success(key, b"\x00not json")


def test_backend_is_async_with_native_join_and_incr() -> None:
    backend = make_backend()
    assert backend.is_async
    assert backend.supports_native_join
    assert backend.implements_incr
    assert backend.apply_chord == backend._apply_chord_incr
    assert backend.supports_autoexpire  # workers clean (backend/autoexpire.py); beat need not
