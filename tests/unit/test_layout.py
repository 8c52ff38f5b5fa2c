from __future__ import annotations

import os
from typing import Any

import pytest

from celery_zk.zk.layout import Layout
from celery_zk.zk.message_names import (
    INLINE_CHARS,
    bucket_name,
    clamp_priority,
    encode_body,
    handed_name,
    inline_body,
    inverted,
    is_legacy,
    message_prefix,
    order_key,
    parse_bucket_name,
    parse_legacy_name,
    parse_message_name,
    requeued_name,
    sort_messages,
    without_body,
)
from celery_zk.zk.names import (
    binding_name,
    escape,
    new_consumer_id,
    offer_name,
    parse_binding_name,
    parse_consumer_name,
    parse_offer_name,
    result_shard,
    unescape,
)


def seq(n: int) -> str:
    return f"{n:010d}"


def new(priority: int, uid: str, n: int, generation: int = 0) -> str:
    """The name ZooKeeper gives a new message (prefix + its sequence)."""
    return message_prefix(inverted(priority), generation, uid) + seq(n)


def requeued(name: str) -> str:
    parsed = parse_message_name(name)
    assert parsed is not None
    return requeued_name(parsed)


def test_message_name_round_trip() -> None:
    name = new(7, "abcdef0123456789", 42, generation=3)
    parsed = parse_message_name(name)
    assert parsed is not None
    assert (parsed.priority, parsed.generation, parsed.uid, parsed.order, parsed.requeued,
            parsed.seq) == (7, 3, "abcdef0123456789", 42, False, 42)
    assert parsed.bucket == bucket_name(2, 3) == "p2-0000000003"
    assert parse_bucket_name(parsed.bucket) == (2, 3)
    assert Layout("/a").unowned_message("q", name) == f"/a/queues/q/unowned/p2-{seq(3)}/{name}"


def test_requeued_name_keeps_its_bucket_and_first_sequence() -> None:
    name = requeued(new(3, "ab", 5, generation=8))
    parsed = parse_message_name(name)
    assert parsed is not None
    assert (parsed.order, parsed.requeued, parsed.priority, parsed.generation) == (5, True, 3, 8)
    assert requeued(name) == name   # requeued again: the same place


def test_a_named_size_is_parsed_and_kept_by_a_requeue() -> None:
    """A queue with x-max-length-bytes names each message's body size."""
    name = message_prefix(2, 4, "ab", "key+1", task="0123abcd", size=1234) + seq(9)
    parsed = parse_message_name(name)
    assert parsed is not None
    assert (parsed.size, parsed.affinity, parsed.task, parsed.order) == (1234, "key+1",
                                                                       "0123abcd", 9)
    again = parse_message_name(requeued(name))
    assert again is not None and (again.size, again.requeued, again.order) == (1234, True, 9)
    assert parse_message_name(new(3, "ab", 5)).size is None   # other queues name none


def test_names_from_before_0_2_are_told_apart_and_parsed_as_they_become() -> None:
    """Read only by `celery zk upgrade`: a flat one goes to bucket 0, keeping its
    first sequence; one in a bucket keeps its bucket; a claimed one loses its owner."""
    flat = "m6-abcdef-" + seq(12)
    flat_requeued = "m6-abcdef-r" + seq(4) + "-" + seq(30)
    bucketed = "m6-" + seq(3) + "-abcdef.0a1b2c3d@key-" + seq(9)
    assert all(map(is_legacy, [flat, flat_requeued, bucketed, "c0123~" + flat]))
    assert not any(map(is_legacy, [new(3, "ab", 5), "not-ours", "c0123~not-ours"]))
    assert all(parse_message_name(name) is None for name in (flat, flat_requeued, bucketed))
    first, again, kept = map(parse_legacy_name, (flat, flat_requeued, bucketed))
    assert first is not None and (first.bucket, first.order, first.requeued) == (
        bucket_name(6, 0), 12, False)
    assert again is not None and (again.order, again.requeued) == (4, True)
    assert kept is not None and (kept.bucket, kept.task, kept.affinity, kept.order) == (
        bucket_name(6, 3), "0a1b2c3d", "key", 9)
    assert requeued_name(kept).startswith("n6-" + seq(3) + "-abcdef")


@pytest.mark.parametrize("priority, expected", [(None, 0), (-3, 0), (0, 0), (5, 5), (9, 9),
                                                (42, 9)])
def test_priority_is_clamped_amqp_style(priority: int | None, expected: int) -> None:
    assert clamp_priority(priority) == expected


def test_sort_orders_by_priority_desc_then_bucket_then_first_sequence() -> None:
    names = [
        new(0, "a1", 1),
        new(9, "a2", 2),
        new(0, "a3", 3),
        new(9, "a4", 4),
        requeued(new(0, "a5", 0)),            # requeued: goes back to the front
        new(0, "a6", 0, generation=1),        # a later bucket: after every earlier one
        requeued(new(0, "a7", 9, generation=1)),
        "not-ours",
    ]
    ordered, foreign = sort_messages(names)
    assert [parse_message_name(n).uid for n in ordered] == [
        "a2", "a4", "a5", "a1", "a3", "a6", "a7"]
    assert foreign == ["not-ours"]


@pytest.mark.parametrize("name", ["", "m1-x-0000000001", "m1-abc-123", "mX-abc-0000000001",
                                  "lock-0000000001", "n1-0000000001-abc-r123",
                                  "n1-0000000001-abc--2147483648", "p1-0000000001",
                                  "m1-0000000001-abc-0000000001"])
def test_foreign_names_are_not_messages(name: str) -> None:
    assert parse_message_name(name) is None


def test_consumer_ids_sort_by_age_and_old_names_still_parse() -> None:
    first, second = new_consumer_id(), new_consumer_id()
    assert first < second and parse_consumer_name(first) == first
    assert parse_consumer_name("cabc123-" + seq(12)) == "cabc123"   # a sequential one
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
    path = layout.inbox_message("a/b", "c1", new(0, "ab", 1))
    assert path == "/app/queues/a%2Fb/owned/c1/" + new(0, "ab", 1)
    assert layout.split_owned_path(path) == ("a/b", "c1", new(0, "ab", 1))
    with pytest.raises(ValueError):   # flat, as celery_zk before 0.2 owned them
        layout.split_owned_path("/app/queues/a%2Fb/owned/c1~" + new(0, "ab", 1))
    with pytest.raises(ValueError):
        layout.split_owned_path("/app/queues/x/unowned/" + new(0, "ab", 1))
    with pytest.raises(ValueError):
        layout.split_owned_path("/app/queues/x/owned/not-ours")


def test_a_message_names_where_its_body_is() -> None:
    layout = Layout("/app")
    apart = parse_message_name(new(2, "ab", 5, generation=3))
    assert apart is not None and not apart.chunked
    assert layout.body("q", apart) == "/app/queues/q/bodies/p7-" + seq(3) + "/ab"
    assert requeued_name(apart).startswith("n7-")


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
    assert offer == "c0123456789ab~abcdef0123456789"
    assert parse_offer_name(offer) == ("c0123456789ab", "abcdef0123456789")
    # An offer that takes a body in a handed name (every one from 0.3 on).
    assert parse_offer_name(offer + "~b") == ("c0123456789ab", "abcdef0123456789~b")
    assert parse_offer_name("x~y") is None and parse_offer_name("c01") is None
    handed = parse_message_name(handed_name(inverted(7), 3, "abcdef0123456789"))
    assert handed is not None
    assert (handed.priority, handed.uid, handed.generation, handed.requeued, handed.seq,
            handed.chunked) == (7, "abcdef0123456789", 3, False, 0, False)


def test_a_requeued_handed_message_sorts_ahead_of_the_first_arrival() -> None:
    """Both have order 0 (the handed one from its name, the other as unowned/'s
    first node): the requeued one was there first."""
    first_arrival = new(0, "b" * 16, 0)
    back = requeued(handed_name(inverted(0), 0, "a" * 16))
    later = new(0, "c" * 16, 2)
    ordered, _ = sort_messages([later, first_arrival, back])
    assert ordered == [back, first_arrival, later]


def test_a_chord_size_node_never_collides_with_a_counted_part() -> None:
    from celery_zk.zk.names import CHORD_SIZE, escape

    layout = Layout("/r")
    assert layout.chord_size("g") == "/r/chords/g/~size"
    for task_id in ("~size", "~", "~x", "size"):
        assert layout.chord_part("g", task_id) != layout.chord_size("g")
        assert not escape(task_id).startswith(CHORD_SIZE[0])


# -- affinity keys in names (celery_zk.features.affinity) ----------------------------------------
@pytest.mark.parametrize("key", ["dataset-42", "a-r", "x-", "s3://b/p", "@#~,%", 7,
                                 "y" * 41, "ünïcode", "\x85\ud800\uf000\ufff0", "😀",
                                 "数据集" * 14])
def test_an_affinity_key_survives_the_name_and_a_requeue(key: object) -> None:
    from celery_zk.zk.message_names import (
        affinity_token,
        message_prefix,
        quick_affinity,
        requeued_name,
    )

    token = affinity_token(key)
    assert "/" not in token and "~" not in token and "@" not in token
    assert token.isascii() and token.isprintable() and len(token) <= 40   # bytes, too
    name = message_prefix(3, 12, "abc", token) + "0000000005"
    parsed = parse_message_name(name)
    assert parsed is not None
    assert (parsed.affinity, parsed.uid, parsed.seq, parsed.inverted_priority) == (
        token, "abc", 5, 3)
    assert quick_affinity(name) == token
    again = parse_message_name(requeued_name(parsed))
    assert again is not None and again.requeued and again.affinity == token
    assert again.sort_key == parsed._replace(requeued=True).sort_key


def test_long_affinity_keys_are_named_by_a_hash_that_no_short_key_gives() -> None:
    from celery_zk.zk.message_names import affinity_token

    assert affinity_token("k" * 40) == "k" * 40
    hashed = affinity_token("k" * 41)
    assert hashed.startswith("#") and hashed != affinity_token("k" * 42)
    assert affinity_token(hashed) != hashed   # a literal "#..." key is escaped
    # The limit counts what the name takes, escapes included: four three-byte
    # characters (36) fit, five (45) are hashed.
    assert affinity_token("数" * 4) == "%E6%95%B0" * 4
    assert affinity_token("数" * 5).startswith("#")


@pytest.mark.parametrize("key", ["", None, True, ["x"], 1.5])
def test_what_cannot_be_an_affinity_key_is_refused_clearly(key: object) -> None:
    from celery_zk.zk.message_names import affinity_token

    with pytest.raises(ValueError, match="affinity key"):
        affinity_token(key)


class _Holdings:   # what a Board says, without a server
    def where(self, token: str) -> Any:
        from celery_zk.features.affinity import Where

        return {"mine": Where.MINE, "theirs": Where.ELSEWHERE}.get(token, Where.NOWHERE)


def _keyed_name(inv: int, seq: int, token: str | None) -> str:
    from celery_zk.zk.message_names import message_prefix

    return message_prefix(inv, 0, f"{seq:x}", token) + f"{seq:010d}"


def test_choose_prefers_held_keys_then_one_free_key_and_never_a_lower_priority() -> None:
    from celery_zk.features import locality

    name = _keyed_name
    listing = [name(0, 1, "theirs"), name(0, 2, None), name(0, 3, "mine"),
               name(0, 4, "free-a"), name(0, 5, "mine"), name(0, 6, "free-b"),
               name(0, 7, "free-a"), name(1, 8, "mine")]
    board: Any = _Holdings()
    waiting = locality.Waiting()
    started = waiting.started

    def choose(names: list[str], limit: int, index: int = 0, idle: bool = True
               ) -> tuple[list[str], float | None]:
        return locality.choose(names, limit, board, waiting, 3.0, index, idle)

    # Held keys and keyless messages first, in queue order; never priority 1.
    assert choose(listing, 10) == ([listing[1], listing[2], listing[4]], None)
    # Without those: the messages of one free key, a different one per consumer.
    free = [listing[0], listing[3], listing[5], listing[6]]
    assert choose(free, 10, index=0) == ([listing[3], listing[6]], None)
    assert started.keys() == {"free-a"}
    # While free-a is not yet said to be held, it counts as this consumer's,
    # and a busy consumer starts no second key...
    assert choose([listing[0], listing[5], listing[6]], 10, idle=False) == ([listing[6]], None)
    batch, retry = choose([listing[5], listing[0]], 10, idle=False)
    # ...but looks again when free-a lapses (the wait, at least a second).
    assert batch == [] and retry is not None and 2.5 < retry <= 3.0
    started.clear()
    assert choose(free, 10, index=1) == ([listing[5]], None)
    # The one held elsewhere: not before it has waited, then by anyone.
    started.clear()
    waiting.seen[listing[0]] -= 3.0
    assert choose(listing[:1], 1) == ([listing[0]], None)


def test_the_oldest_message_is_taken_after_the_wait_whatever_else_waits() -> None:
    """Under a steady backlog of local work, a key nobody holds (or whose
    holder does not come) still gets taken: once the oldest message has been
    the oldest for locality_wait, whoever looks takes it."""
    from celery_zk.features import locality

    name = _keyed_name
    board: Any = _Holdings()
    for head_key in ("free-x", "theirs"):
        waiting = locality.Waiting()
        listing = [name(0, 1, head_key)] + [name(0, seq, "mine") for seq in range(2, 6)]
        # Local work waits behind it: the consumer takes that, not the head...
        for _ in range(2):
            assert locality.choose(listing, 2, board, waiting, 3.0, idle=False) == (
                listing[1:3], None)
        # ...until the head has been the head for the wait: then it goes first.
        waiting.head_since -= 3.0
        assert locality.choose(listing, 2, board, waiting, 3.0, idle=False) == (
            listing[:2], None)
        # A key nobody holds is now this consumer's to load; another's is not.
        assert waiting.started.keys() == ({"free-x"} if head_key == "free-x" else set())
        # A batch put back at the front of the listing does not hide the oldest.
        assert locality.choose(listing[2:3] + listing[:2] + listing[3:], 1, board, waiting,
                               3.0, idle=False)[0] == listing[:1]
        # Once it is taken, the next oldest starts its own wait.
        assert locality.choose(listing[1:], 1, board, waiting, 3.0,
                               idle=False)[0] == listing[1:2]
        assert waiting.head == listing[1]


def test_an_empty_choice_says_when_to_look_again() -> None:
    from celery_zk.features import locality

    name = _keyed_name
    board: Any = _Holdings()
    theirs = [name(0, 1, "theirs"), name(0, 2, "theirs")]
    batch, retry = locality.choose(theirs, 10, board, locality.Waiting(), 3.0)
    assert batch == [] and retry is not None and 2.9 < retry <= 3.0
    # With the wait at 0, the oldest is taken at once.
    assert locality.choose(theirs, 1, board, locality.Waiting(), 0.0) == (theirs[:1], None)



def test_a_worker_starting_gets_an_id_of_its_own() -> None:
    """Processes forked from one parent that imported celery_zk are different
    workers once each starts (worker_init); its pool processes inherit it."""
    from celery import signals

    from celery_zk import affinity

    before = affinity.WORKER
    signals.worker_init.send(sender=None)
    assert affinity.WORKER != before and len(affinity.WORKER) == 12



def test_a_handed_name_carries_its_body_and_says_what_the_thin_name_says() -> None:
    body = b'{"body": "W1tdLCB7fV0=", "headers": {"task": "proj.add"}}' * 8
    thin = handed_name(inverted(3), 5, "abcdef0123456789", task="0a1b2c3d")
    fat = handed_name(inverted(3), 5, "abcdef0123456789", task="0a1b2c3d",
                      body=encode_body(body))
    assert fat.startswith(thin + "~") and inline_body(fat) == body
    assert without_body(fat) == thin and parse_message_name(fat) == parse_message_name(thin)
    assert order_key(fat) == (order_key(thin)[0], fat)   # type: ignore[index]
    # A requeue names it thin: the copy stays out of the queue's listings.
    assert requeued_name(parse_message_name(fat)) == requeued(thin)  # type: ignore[arg-type]
    layout = Layout("/r")
    assert layout.split_owned_path(layout.inbox_message("q", "c0123456789ab", fat)) == (
        "q", "c0123456789ab", fat)
    # Names without a copy, and 0.1's flat owned names (consumer~name), are left alone.
    assert inline_body(thin) is None and without_body(thin) is thin
    flat = f"c0123456789ab~{new(0, 'a' * 16, 4)}"
    assert without_body(flat) is flat and parse_message_name(flat) is None
    # A copy that does not decode is no body: the consumer reads the body node.
    assert inline_body(thin + "~AAAA") is None and parse_message_name(thin + "~AAAA")
    assert parse_message_name(thin + "~not/base64!") is None
    # What does not fit stays out of the name.
    assert encode_body(os.urandom(3000)) is None and encode_body(os.urandom(9000)) is None
    assert len(encode_body(body) or "") < INLINE_CHARS
