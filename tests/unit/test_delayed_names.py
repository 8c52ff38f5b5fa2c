"""Delayed messages' names and the eta a message asks for (celery_zk.broker.delayed)."""
from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

from celery_zk.broker.delayed import DELAY_FROM, due
from celery_zk.zk.message_names import (
    DELAYED_BUCKET_MS,
    DELAYED_DAY_MS,
    delayed_bucket,
    delayed_uid,
    due_of,
    parse_delayed_bucket,
    parse_delayed_day,
    parse_message_name,
    promoted_name,
    sort_messages,
)


def _eta(seconds: float, tz: timezone | None = timezone.utc) -> dict:
    when = datetime.now(timezone.utc) + timedelta(seconds=seconds)
    return {"headers": {"eta": (when if tz else when.replace(tzinfo=None)).isoformat()}}


def test_an_eta_far_enough_ahead_is_delayed_to_the_millisecond() -> None:
    message = _eta(30)
    expected = datetime.fromisoformat(message["headers"]["eta"]).timestamp() * 1000
    assert due(message) == int(expected)
    tokyo = timezone(timedelta(hours=9))   # any zone: the same instant
    eta = (datetime.now(tokyo) + timedelta(seconds=30)).isoformat()
    assert abs(due({"headers": {"eta": eta}}) - (time.time() + 30) * 1000) < 1000


def test_what_is_delivered_at_once() -> None:
    assert due(_eta(DELAY_FROM / 2)) is None          # near: the worker waits
    assert due(_eta(-5)) is None                      # gone by
    assert due(_eta(30, tz=None)) is None             # naive: the app's zone, unknown here
    assert due({"headers": {"eta": "tomorrow"}}) is None
    assert due({"headers": {"eta": None}}) is None and due({}) is None
    assert due({"headers": None}) is None


def test_a_delayed_name_says_when_it_is_due_and_where_it_waits() -> None:
    due_ms = 1_796_476_485_502
    uid = delayed_uid(due_ms, "cf2358c69e6a4f1f")
    day, bucket = delayed_bucket(due_ms, 3)
    assert parse_delayed_day(day) == due_ms // DELAYED_DAY_MS * DELAYED_DAY_MS
    assert parse_delayed_bucket(bucket) == (due_ms // DELAYED_BUCKET_MS * DELAYED_BUCKET_MS, 3)
    assert parse_delayed_bucket("p0-0000000001") is None and parse_delayed_day("x1") is None
    name = f"n4-0000000007-{uid}.e41998ab-0000000042"
    message = parse_message_name(name)
    assert message is not None and due_of(message) == due_ms
    assert due_of(parse_message_name("n4-0000000007-cf2358c6-0000000042")) is None


def test_promoted_names_wait_at_the_front_of_their_priority_earliest_due_first() -> None:
    def delayed(due_ms: int, priority_inv: int = 4) -> str:
        return promoted_name(parse_message_name(
            f"n{priority_inv}-0000000007-{delayed_uid(due_ms, 'ab')}.e41998ab@key-0000000042"))
    later, earlier = delayed(2_000_000_000_000), delayed(1_000_000_000_000)
    backlog = "n4-0000000007-ffff-0000000001"
    other_priority = "n3-0000000009-ffff-0000000005"
    assert sort_messages([backlog, later, earlier, other_priority])[0] == [
        other_priority, earlier, later, backlog]
    promoted = parse_message_name(later)
    assert promoted is not None and not promoted.requeued   # never delivered: not redelivered
    assert (promoted.affinity, promoted.task, promoted.generation) == ("key", "e41998ab", 7)
