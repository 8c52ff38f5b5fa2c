"""The dispatcher's view of a queue's head (``Head``): kept in delivery order
as names are listed, arrive and are given."""
from __future__ import annotations

from celery_zk.broker.assignment import Head
from celery_zk.zk.message_names import parse_message_name


def names(count: int, affinity_every: int = 0) -> list[str]:
    made = []
    for i in range(count):
        key = "@k" if affinity_every and i % affinity_every == 0 else ""
        made.append(f"n9-{0:010d}-{i:016x}{key}-{i:010d}")
    assert all(parse_message_name(name) is not None for name in made)
    return made


def test_what_a_plan_gives_from_the_front_is_cut_at_once_and_the_rest_kept() -> None:
    listed = names(10, affinity_every=3)
    head = Head()
    head.reset(listed, complete=True)
    assert head.keyed == 4
    head.discard(listed[:4])            # the head's first names: one cut
    assert head.names == listed[4:] and len(head.keys) == 6 and head.keyed == 2
    head.discard(iter([listed[7]]))     # one from the middle
    head.discard([listed[4], listed[9], "n9-not-a-message"])   # front, end, foreign
    assert head.names == [listed[5], listed[6], listed[8]]
    assert [key[1] for key in head.keys] == head.names and head.keyed == 1


def test_a_name_given_that_the_head_does_not_hold_changes_nothing() -> None:
    listed = names(4)
    head = Head()
    head.reset(listed[1:], complete=False)
    head.discard([listed[0], listed[1]])   # one known, one never listed
    assert head.names == listed[2:]
