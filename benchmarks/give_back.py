"""What a lookahead's give-back (design.md, *Lookahead*) costs the worker's
event loop: the buffer's last ``k`` of ``n`` messages chosen and dropped.

``Ready.latest`` + ``Ready.remove`` (one selection, one heapify) against the
way before 2026-12-02, reproduced here: a scan for the last and a heapify
per message given back, O(n·k). Pure Python, no ZooKeeper::

    .venv/bin/python benchmarks/give_back.py
"""
from __future__ import annotations

import heapq
import timeit

from celery_zk.broker.claims import Claimed
from celery_zk.broker.ready import DeliveryOrder, Ready
from celery_zk.zk.layout import message_prefix, parse_message_name

SHAPES = [(16, 12), (164, 100), (1024, 900)]   # (buffer, given back)


def fill(n: int) -> Ready:
    ready, order = Ready(), DeliveryOrder()
    for seq in range(1, n + 1):
        name = message_prefix(0, 0, f"{seq:x}") + f"{seq:010d}"
        message = parse_message_name(name)
        assert message is not None
        ready.push(Claimed("q", name, f"/q/owned/c/{name}", b"", 0.0), order.key(message))
    return ready


def one_at_a_time(ready: Ready, k: int) -> None:
    heap = ready._heap   # the old methods worked on the heap itself
    for _ in range(k):
        last = max(range(len(heap)), key=lambda index: heap[index][0])
        heap[last] = heap[-1]
        heap.pop()
        heapq.heapify(heap)


def at_once(ready: Ready, k: int) -> None:
    ready.remove(ready.latest(k))


def cost(n: int, k: int, give_back: object) -> float:
    """Microseconds of one give-back, the buffer's filling subtracted."""
    base = min(timeit.repeat(lambda: fill(n), number=20, repeat=5)) / 20
    took = min(timeit.repeat(lambda: give_back(fill(n), k),  # type: ignore[operator]
                             number=20, repeat=5)) / 20
    return (took - base) * 1e6


def main() -> None:
    print(f"{'buffer':>7} {'given back':>10} {'one at a time, us':>18} {'at once, us':>12}")
    for n, k in SHAPES:
        print(f"{n:>7} {k:>10} {cost(n, k, one_at_a_time):>18,.0f} "
              f"{cost(n, k, at_once):>12,.0f}")


if __name__ == "__main__":
    main()
