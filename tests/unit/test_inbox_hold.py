"""The lookahead's hold (design.md, *Lookahead*): what the pace of the last
deliveries would not deliver within HOLD s, and the order it goes back in."""
from __future__ import annotations

from celery_zk.broker.credit import HOLD, held_back
from celery_zk.broker.ready import Claimed, DeliveryOrder, Ready
from celery_zk.zk.message_names import message_prefix, order_key, parse_message_name


def test_a_quick_pace_holds_nothing_back_however_deep_the_inbox() -> None:
    # 16 deliveries in 20 ms (a prefork worker draining no-op tasks): 800/s.
    took = [10.0 + i * 0.00125 for i in range(16)]
    assert held_back(256, took, 10.02) == 0


def test_a_trickle_holds_back_all_but_what_it_delivers_within_hold() -> None:
    # 2 deliveries over the last 2 s: 1/s, so HOLD s deliver one.
    assert held_back(30, [8.0, 9.0], 10.0) == 30 - int(2 * HOLD / 2.0)


def test_no_delivery_for_long_holds_back_everything() -> None:
    assert held_back(30, [0.0, 0.1], 100.0) == 30
    assert held_back(5, [], 1.0) == 5


def test_nothing_waiting_is_never_held_back() -> None:
    assert held_back(0, [], 1.0) == 0


def claimed(name: str) -> Claimed:
    return Claimed("q", name, f"/q/owned/c/{name}", b"", 0.0)


def test_the_buffer_gives_back_its_last_in_the_queues_order_first() -> None:
    # (inverted priority, generation, sequence): priority first, then FIFO.
    names = [message_prefix(p, g, f"{p:x}{g:x}{seq:x}") + f"{seq:010d}"
             for p, g, seq in [(4, 1, 2), (1, 3, 1), (4, 1, 1), (4, 0, 7)]]
    ready, order = Ready(), DeliveryOrder()
    for name in names:
        message = parse_message_name(name)
        assert message is not None
        ready.push(claimed(name), order.key(message))
    in_order = sorted(names, key=order_key)
    assert in_order == [names[1], names[3], names[2], names[0]]
    last_two = ready.latest(2)
    assert [c.name for c in last_two] == [in_order[-1], in_order[-2]]
    assert [c.name for c in ready.latest(9)] == in_order[::-1]
    assert len(ready) == 4   # chosen, not taken: only what went back is removed
    ready.remove(last_two[:1])   # the second's requeue failed: it stays
    assert [c.name for c in ready.latest(1)] == [in_order[-2]]
    ready.remove(last_two[1:])
    ready.remove([])
    assert [ready.pop().name for _ in range(len(ready))] == in_order[:2]


def test_removing_from_the_buffer_keeps_the_delivery_order_of_the_rest() -> None:
    names = [message_prefix(0, 0, f"{seq:x}") + f"{seq:010d}" for seq in range(1, 51)]
    ready, order = Ready(), DeliveryOrder()
    for name in reversed(names):
        message = parse_message_name(name)
        assert message is not None
        ready.push(claimed(name), order.key(message))
    in_order = sorted(names, key=order_key)
    assert [c.name for c in ready.latest(20)] == in_order[:29:-1]
    ready.remove(ready.latest(20))
    assert [ready.pop().name for _ in range(len(ready))] == in_order[:30]
