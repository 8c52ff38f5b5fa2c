"""celery_zk.client's pure helpers: reading multi results, logging background failures."""
from __future__ import annotations

import logging

import pytest
from kazoo.exceptions import (
    BadVersionError,
    ConnectionClosedError,
    NoNodeError,
    RolledBackError,
    RuntimeInconsistency,
)

from celery_zk.client import log_failure, multi_failure

log = logging.getLogger("celery_zk.test")


def test_multi_failure_names_the_op_that_failed() -> None:
    assert multi_failure([None, "/a"]) is None
    failure = multi_failure([RolledBackError(), BadVersionError(), RuntimeInconsistency()])
    assert failure is not None
    index, error = failure
    assert index == 1 and isinstance(error, BadVersionError)


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
