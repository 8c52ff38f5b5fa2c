"""celery_zk.zk.client's pure helpers: reading multi results, logging background failures,
holding writes back."""
from __future__ import annotations

import logging
import threading
import time

import pytest
from kazoo.exceptions import (
    BadVersionError,
    ConnectionClosedError,
    NoNodeError,
    RolledBackError,
    RuntimeInconsistency,
)

from celery_zk.zk.background import Deferred
from celery_zk.zk.client import RedoThread, json_object, log_failure, multi_failure, unwaited

log = logging.getLogger("celery_zk.test")


def test_multi_failure_names_the_op_that_failed() -> None:
    assert multi_failure([None, "/a"]) is None
    failure = multi_failure([RolledBackError(), BadVersionError(), RuntimeInconsistency()])
    assert failure is not None
    index, error = failure
    assert index == 1 and isinstance(error, BadVersionError)


def test_an_unwaited_reply_logs_only_what_was_not_expected(
        caplog: pytest.LogCaptureFixture) -> None:
    from kazoo.handlers.threading import SequentialThreadingHandler
    handler = SequentialThreadingHandler()
    handler.start()
    try:
        with caplog.at_level(logging.DEBUG, logger="celery_zk.test"):
            for outcome in (None, NoNodeError(), BadVersionError()):
                result = handler.async_result()
                unwaited(result, log, "could not delete %s", "/a", expected=(NoNodeError,))
                if outcome is None:
                    result.set("/a")
                else:
                    result.set_exception(outcome)
            deadline = time.monotonic() + 5
            while not caplog.records and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)   # anything else the callback thread would have logged
    finally:
        handler.stop()
    (record,) = caplog.records
    assert record.getMessage() == "could not delete /a"
    assert record.exc_info is not None and isinstance(record.exc_info[1], BadVersionError)


def test_json_object_reads_only_objects() -> None:
    assert json_object(b'{"credit": 4}') == {"credit": 4}
    for data in (None, b"", b"[1]", b"not json", b'"a"'):
        assert json_object(data) == {}


def test_a_lost_connection_is_a_plain_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="celery_zk.test"):
        log_failure(log, ConnectionClosedError("Connection has been closed"),
                    "could not ack %s", "m1", level=logging.ERROR)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert record.getMessage() == (
        "could not ack m1 (ConnectionClosedError: Connection has been closed)")


def test_anything_else_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="celery_zk.test"):
        log_failure(log, NoNodeError(), "could not ack %s", "m1", level=logging.ERROR)
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert record.getMessage() == "could not ack m1"


def test_deferred_sends_after_the_delay_in_order_on_the_background_thread() -> None:
    deferred = Deferred(0.05)
    sent: list[tuple[int, str]] = []
    for _batch in range(3):
        start = time.monotonic()
        for n in range(3):
            deferred.later(lambda n=n: sent.append((n, threading.current_thread().name)))
        assert sent == []   # held back
        deadline = time.monotonic() + 5
        while len(sent) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert time.monotonic() - start >= 0.05
        assert [n for n, _ in sent] == [0, 1, 2]
        assert {name for _, name in sent} == {"celery_zk-background"}
        sent.clear()
    deferred.later(lambda: sent.append((9, "")))
    deferred.flush()   # sends at once
    assert sent == [(9, "")]


def test_a_write_held_longer_goes_with_a_sooner_one() -> None:
    """Acks may wait ACK_HOLD; a write due sooner takes them along, and a long
    hold alone is kept (a deep inbox's acks go together, not one multi each)."""
    deferred = Deferred(0.02)
    sent: list[str] = []
    deferred.later(lambda: sent.append("ack"), 60)
    time.sleep(0.1)
    assert sent == []   # held: 60 s, not the instance's 0.02
    start = time.monotonic()
    deferred.later(lambda: sent.append("offer"))
    deadline = time.monotonic() + 5
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sent == ["ack", "offer"]
    assert time.monotonic() - start < 5
    deferred.later(lambda: sent.append("late"), 60)
    deferred.later(lambda: sent.append("soon"), 0.02)   # a sooner due replaces the later one
    deadline = time.monotonic() + 5
    while len(sent) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sent[2:] == ["late", "soon"]


def test_deferred_flush_sends_now_and_survives_a_failing_send() -> None:
    deferred = Deferred(60)
    sent: list[int] = []

    def broken() -> None:
        raise ConnectionError("closed")

    deferred.later(broken)
    deferred.later(lambda: sent.append(1))
    deferred.flush()
    assert sent == [1]


def test_a_redo_thread_can_be_waited_for() -> None:
    """Closing a connection waits for the acks its RedoThread still has to send."""
    done: list[int] = []
    release = threading.Event()

    def work(item: int) -> None:
        if item == 3:
            release.wait(5)
        else:
            time.sleep(0.05)
        done.append(item)

    redo: RedoThread[int] = RedoThread("test-redo", work)
    assert redo.join(0.01)   # nothing submitted
    redo.submit(1)
    redo.submit(2)
    assert redo.join(5) and done == [1, 2]
    redo.submit(3)
    assert not redo.join(0.05)   # still at work
    release.set()
    assert redo.join(5) and done == [1, 2, 3]
