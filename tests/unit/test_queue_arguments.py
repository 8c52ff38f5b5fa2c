"""Queue arguments as RabbitMQ defines them: validation, storage, lifetimes;
and the budget's reading of the servers' quota stats."""
from __future__ import annotations

import json

import pytest

from celery_zk.broker.budget import Use
from celery_zk.broker.queue_arguments import (
    DROP_HEAD,
    REJECT_PUBLISH,
    Limits,
    expired,
    meta,
)
from celery_zk.broker.queue_limits import dropped_counts
from celery_zk.exceptions import ZKConfigurationError


def test_limits_from_arguments() -> None:
    limits = Limits.of("q", {"x-message-ttl": 1500, "x-max-length": 10,
                             "x-overflow": "reject-publish-dlx", "x-max-priority": 9})
    assert limits == Limits(1.5, 10, overflow=REJECT_PUBLISH)
    assert Limits.of("q", {}) == Limits(None, None, overflow=DROP_HEAD)
    assert Limits.of("q", {"x-max-length-bytes": 4096, "x-expires": 1800000}) == Limits(
        max_length_bytes=4096, expires=1800.0)


@pytest.mark.parametrize("arguments, says", [
    ({"x-overflow": "drop-tail"}, "x-overflow must be one of drop-head, reject-publish"),
    ({"x-max-length": -1}, "x-max-length must be a whole number"),
    ({"x-message-ttl": "soon"}, "x-message-ttl must be a whole number"),
    ({"x-max-length": True}, "x-max-length must be a whole number"),
    ({"x-max-length-bytes": 1.5}, "x-max-length-bytes must be a whole number"),
    ({"x-expires": 0}, "x-expires must be at least 1"),
])
def test_bad_arguments_say_what_and_where(arguments: dict, says: str) -> None:
    with pytest.raises(ZKConfigurationError, match=says) as error:
        Limits.of("orders", arguments)
    assert "'orders'" in str(error.value) and "Nothing was declared" in str(error.value)


def test_stored_with_the_queue() -> None:
    data = meta({"x-max-length": 5, "x-max-priority": 9, "x-foo": 1}, auto_delete=False)
    assert json.loads(data) == {"auto_delete": False, "arguments": {"x-max-length": 5}}
    assert Limits.stored(meta({"x-expires": 60000, "x-max-length-bytes": 9},
                              auto_delete=False)) == Limits(max_length_bytes=9, expires=60.0)
    assert Limits.stored(data) == Limits(None, 5, overflow=DROP_HEAD)
    # A queue declared before 0.4 (no arguments), or damaged data: no limits.
    assert Limits.stored(b'{"auto_delete": false}') == Limits()
    assert Limits.stored(b"\x00junk") == Limits()
    # An auto-delete queue's (its publishes pass a full budget), 0.4's and older.
    assert Limits.stored(meta({"x-message-ttl": 10}, auto_delete=True)) == Limits(
        0.01, temporary=True)
    assert Limits.stored(b'{"auto_delete": true}').temporary


def test_expired_by_the_queue_or_the_message() -> None:
    stored = 1000.0
    assert expired({}, stored, None, stored + 3600) is None
    assert expired({}, None, 1.0, stored + 3600) is None   # handed over just now
    assert "x-message-ttl of 1000 ms" in expired({}, stored, 1.0, stored + 1.0)
    assert expired({}, stored, 1.0, stored + 0.999) is None
    assert "expiration of 200 ms" in expired({"expiration": "200"}, stored, None, stored + 0.2)
    both = expired({"expiration": "200"}, stored, 0.1, stored + 0.3)
    assert "x-message-ttl" in both and "expiration" in both
    assert expired({"expiration": "garbage"}, stored, None, stored + 10) is None


def test_quota_stats_and_dropped_counts_parse() -> None:
    assert Use.parse(b"count=12,bytes=3400") == Use(12, 3400)
    assert Use.parse(b"count=12,bytes=3400,countHardLimit=5") == Use(12, 3400)
    assert Use.parse(b"") is None and Use.parse(b"count=x,bytes=1") is None
    assert dropped_counts(b'{"expired": 3, "dropped": 2, "x": "y"}') == {
        "expired": 3, "dropped": 2}
    assert dropped_counts(b"[1]") == {} and dropped_counts(b"nope") == {}
