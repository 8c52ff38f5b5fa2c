from __future__ import annotations

import pytest

from celery_zk.layout import (
    Layout,
    binding_name,
    clamp_priority,
    escape,
    handed_name,
    message_prefix,
    offer_name,
    owned_name,
    parse_binding_name,
    parse_consumer_name,
    parse_message_name,
    parse_offer_name,
    result_shard,
    sort_messages,
    split_owned_name,
    unescape,
)


def seq(n: int) -> str:
    return f"{n:010d}"


def test_message_name_round_trip() -> None:
    name = message_prefix(7, "abcdef0123456789") + seq(42)
    parsed = parse_message_name(name)
    assert parsed is not None
    assert (parsed.priority, parsed.uid, parsed.first_seq, parsed.seq) == (7, "abcdef0123456789",
                                                                           None, 42)


def test_requeued_name_keeps_first_sequence() -> None:
    name = message_prefix(3, "ab", first_seq=5) + seq(99)
    parsed = parse_message_name(name)
    assert parsed is not None and parsed.order == 5 and parsed.seq == 99 and parsed.priority == 3


@pytest.mark.parametrize("priority, expected", [(None, 0), (-3, 0), (0, 0), (5, 5), (9, 9),
                                                (42, 9)])
def test_priority_is_clamped_amqp_style(priority: int | None, expected: int) -> None:
    assert clamp_priority(priority) == expected


def test_sort_orders_by_priority_desc_then_first_sequence() -> None:
    names = [
        message_prefix(0, "a1") + seq(1),
        message_prefix(9, "a2") + seq(2),
        message_prefix(0, "a3") + seq(3),
        message_prefix(9, "a4") + seq(4),
        message_prefix(0, "a5", first_seq=0) + seq(10),  # requeued: goes back to the front
        "not-ours",
    ]
    ordered, foreign = sort_messages(names)
    assert [parse_message_name(n).uid for n in ordered] == ["a2", "a4", "a5", "a1", "a3"]
    assert foreign == ["not-ours"]


@pytest.mark.parametrize("name", ["", "m1-x-0000000001", "m1-abc-123", "mX-abc-0000000001",
                                  "lock-0000000001"])
def test_foreign_names_are_not_messages(name: str) -> None:
    assert parse_message_name(name) is None


def test_owned_name_round_trip() -> None:
    message = message_prefix(1, "ff") + seq(7)
    assert split_owned_name(owned_name("c0123", message)) == ("c0123", message)
    assert split_owned_name("garbage") is None


def test_consumer_name() -> None:
    assert parse_consumer_name("cabc123-" + seq(12)) == ("cabc123", 12)
    assert parse_consumer_name("zz") is None


@pytest.mark.parametrize("text", ["celery", "celery@host.celery.pidbox", "a/b", "50%", "x,y~z",
                                  "", ".", "..", "zookeeper", "tab\there", "ünïcode"])
def test_escape_round_trip_and_safe(text: str) -> None:
    escaped = escape(text)
    assert "/" not in escaped and "," not in escaped and "~" not in escaped
    assert escaped not in ("", ".", "..", "zookeeper")
    assert unescape(escaped) == text


def test_binding_name_round_trip() -> None:
    assert parse_binding_name(binding_name("q,1", "a.#")) == ("q,1", "a.#")


def test_paths_are_under_root_and_owned_path_inverts() -> None:
    layout = Layout("/app")
    assert layout.unowned("a/b") == "/app/queues/a%2Fb/unowned"
    path = layout.owned_message("a/b", owned_name("c1", "m9-ab-" + seq(1)))
    assert layout.split_owned_path(path) == ("a/b", "c1", "m9-ab-" + seq(1))
    with pytest.raises(ValueError):
        layout.split_owned_path("/app/queues/x/unowned/m9-ab-" + seq(1))
    with pytest.raises(ValueError):
        layout.split_owned_path("/app/queues/x/owned/not-ours")


def test_result_shards_bound_directory_size() -> None:
    shards = {result_shard(f"task-{i}") for i in range(20000)}
    assert len(shards) == 256  # a million results: ~3,900 per directory
    assert Layout("/r").result("t1").startswith("/r/results/" + result_shard("t1") + "/")
    # The backend makes a level's shard directories all at once: they must be all of them.
    layout = Layout("/r")
    assert {Layout.parent(layout.result(f"task-{i}")) for i in range(20000)} == set(
        layout.shards(layout.results))
    assert {Layout.parent(layout.expiry_entry(7, "r", f"task-{i}")) for i in range(20000)} == set(
        layout.shards(layout.expiry_bucket(7)))
    assert Layout.parent(layout.group("g")) in layout.shards(layout.groups)


def test_offer_and_handed_names() -> None:
    offer = offer_name("c0123456789ab", "abcdef0123456789")
    assert parse_offer_name(offer) == ("c0123456789ab", "abcdef0123456789")
    assert parse_offer_name("x~y") is None and parse_offer_name("c01") is None
    handed = parse_message_name(handed_name(7, "abcdef0123456789"))
    assert handed is not None
    assert (handed.priority, handed.uid, handed.first_seq, handed.seq) == (
        7, "abcdef0123456789", None, 0)


def test_a_requeued_handed_message_sorts_ahead_of_the_first_arrival() -> None:
    """Both have order 0 (the handed one from its name, the other as unowned/'s
    first node): the requeued one was there first."""
    first_arrival = message_prefix(0, "b" * 16) + seq(0)
    requeued = message_prefix(0, "a" * 16, first_seq=0) + seq(1)
    later = message_prefix(0, "c" * 16) + seq(2)
    ordered, _ = sort_messages([later, first_arrival, requeued])
    assert ordered == [requeued, first_arrival, later]


def test_a_chord_size_node_never_collides_with_a_counted_part() -> None:
    from celery_zk.layout import CHORD_SIZE, escape

    layout = Layout("/r")
    assert layout.chord_size("g") == "/r/chords/g/~size"
    for task_id in ("~size", "~", "~x", "size"):
        assert layout.chord_part("g", task_id) != layout.chord_size("g")
        assert not escape(task_id).startswith(CHORD_SIZE[0])
