"""An inbox's delivery order (celery_zk.broker.ready): the queue's order, and
handed messages behind what arrived before them, in the order they came."""
from __future__ import annotations

from celery_zk.broker.ready import Claimed, DeliveryOrder, Ready
from celery_zk.zk.message_names import (
    handed_name,
    inverted,
    message_prefix,
    parse_message_name,
    requeued_name,
)


def new(priority: int, uid: str, n: int, generation: int = 0) -> str:
    """The name ZooKeeper gives a new message (prefix + its sequence)."""
    return message_prefix(inverted(priority), generation, uid) + f"{n:010d}"


def handed(priority: int, uid: str, generation: int = 0) -> str:
    return handed_name(inverted(priority), generation, uid)


def requeued(name: str) -> str:
    parsed = parse_message_name(name)
    assert parsed is not None
    return requeued_name(parsed)


def delivered(arrived: list[str]) -> list[str]:
    """What an inbox that learnt of ``arrived`` in that order delivers, in order."""
    ready, order = Ready(), DeliveryOrder()
    for name in arrived:
        message = parse_message_name(name)
        assert message is not None
        ready.push(Claimed("q", name, "/owned/" + name, b"{}", 0.0), order.key(message))
    out = [ready.pop().name for _ in range(len(ready))]
    assert not ready and ready.first_key() is None
    return out


def test_an_inbox_delivers_what_it_read_in_the_queues_order() -> None:
    """Read in the order they arrived (a deep inbox's batch, then a message of a
    higher priority given later, then one requeued to an earlier place), they
    go out in the queue's order: priority, then bucket and sequence."""
    arrived = [new(0, "a" * 16, 5), new(0, "b" * 16, 6), new(0, "c" * 16, 7),
               new(9, "d" * 16, 8), requeued(new(0, "e" * 16, 2)),
               new(0, "f" * 16, 5, generation=1)]
    assert delivered(arrived) == [arrived[3], arrived[4], arrived[0], arrived[1], arrived[2],
                                  arrived[5]]


def test_handed_messages_go_in_the_order_they_came_behind_what_came_before() -> None:
    """Their names' sequence is zero and their uids random: by name, the third
    of a publisher's messages (handed over) went out before its first (given
    by the dispatcher a moment before), and handed ones among themselves in the
    order of their uids."""
    given = new(0, "f" * 16, 40)
    arrived = [given, handed(0, "c" * 16), handed(0, "a" * 16), handed(0, "b" * 16)]
    assert delivered(arrived) == arrived


def test_what_is_given_later_from_an_earlier_place_still_goes_first() -> None:
    """A handed message keeps its place behind what came before it, not ahead
    of everything: a message given after it from earlier in the queue (a
    requeued one, an older one another publisher put in line) goes first, and
    one of a higher priority too."""
    first, hand = new(0, "a" * 16, 40), handed(0, "e" * 16)
    older, urgent = new(0, "b" * 16, 12), handed(9, "f" * 16)
    back = requeued(new(0, "c" * 16, 3))
    later = new(0, "d" * 16, 41)
    assert delivered([first, hand, older, back, later, urgent]) == [
        urgent, back, older, first, hand, later]


def test_a_handed_message_of_a_newer_bucket_keeps_its_own_place() -> None:
    old, hand = new(0, "a" * 16, 4095), handed(0, "b" * 16, generation=1)
    given = new(0, "c" * 16, 1, generation=1)
    assert delivered([old, hand, given]) == [old, hand, given]
