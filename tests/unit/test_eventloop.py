"""The wake-up a blocking consumer and Celery's event loop wait on (``Waker``)."""
from __future__ import annotations

import os
import random
import select
import threading

from celery_zk.broker.eventloop import Waker


def readable(waker: Waker) -> bool:
    return bool(select.select([waker.fileno()], [], [], 0)[0])


def pipe_bytes(waker: Waker) -> int:
    read = waker._fds[0]
    taken = 0
    try:
        while True:
            chunk = os.read(read, 4096)
            if not chunk:
                break
            taken += len(chunk)
    except BlockingIOError:
        pass
    return taken


def test_a_set_waker_is_not_written_again() -> None:
    waker = Waker()
    waker.fileno()
    waker.set()
    waker.set()
    waker.set()
    assert waker.is_set()
    assert pipe_bytes(waker) == 1   # one byte for three sets: one wake-up of the loop


def test_after_a_clear_the_next_set_makes_the_pipe_readable_again() -> None:
    waker = Waker()
    waker.fileno()
    waker.set()
    waker.clear()
    assert not waker.is_set() and not readable(waker)
    waker.set()
    assert waker.is_set() and readable(waker)


def test_a_waker_set_before_its_pipe_existed_is_readable_at_once() -> None:
    waker = Waker()
    waker.set()
    waker.fileno()
    assert readable(waker)


def test_a_set_event_always_has_a_byte_to_read() -> None:
    """Whatever the order of sets and clears, a set waker wakes the event loop:
    otherwise every later set() skips its write and the loop sleeps for good."""
    waker = Waker()
    waker.fileno()
    rng = random.Random(7)
    for _ in range(2000):
        if rng.random() < 0.6:
            waker.set()
        else:
            waker.clear()
        assert not waker.is_set() or readable(waker)


def test_no_wake_up_is_lost_between_threads() -> None:
    """A setter records work then sets; the waiter, woken through the pipe,
    clears and then looks at the work: it sees every item, without a poll."""
    waker = Waker()
    fd = waker.fileno()
    done: list[int] = []
    total = 20000

    def setter() -> None:
        for i in range(total):
            done.append(i)   # the state first, then the wake-up
            waker.set()

    thread = threading.Thread(target=setter)
    thread.start()
    seen = 0
    while seen < total:
        # A lost wake-up leaves items unseen with nothing to read: the select
        # times out and the test fails instead of hanging.
        assert select.select([fd], [], [], 5.0)[0], f"asleep with {total - seen} unseen"
        waker.clear()
        seen = len(done)
    thread.join()
