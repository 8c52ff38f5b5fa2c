"""A pytest plugin for Celery's suite: when did a task arrive at the worker,
and when did the ``apply_async`` that sent it return?

It shows why ``test_replaced_task_nesting_level_0`` fails on zk (see
``celery_redis_failures.txt``): that test resets its flag *after* ``delay()``
returns, while the suite's worker runs in the test's own process and its
``task_received`` handler sets the flag. Run::

    RECEIVED_ORDER_LOG=/tmp/received_order.log PYTHONPATH=$PWD/tests/upstream \
        .venv/bin/python tests/upstream/celery_suite.py -- -p received_order -k test_tasks.py

and read the log: a ``received`` line before the ``returned`` line of the
same task id is the race lost. (Without ``RECEIVED_ORDER_LOG`` the log is
``received_order.log`` where pytest runs: the suite's sdist under ``.cache/``.)
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any

import celery.canvas
from celery.signals import task_received

LOG = os.environ.get("RECEIVED_ORDER_LOG", os.path.abspath("received_order.log"))
WATCHED = "test_replaced_task_nesting_level_0"

_events: list[tuple[float, str, str | None, str]] = []
_apply_async = celery.canvas.Signature.apply_async


def _recorded_apply_async(self: Any, *args: Any, **kwargs: Any) -> Any:
    result = _apply_async(self, *args, **kwargs)
    _events.append((time.perf_counter(), "returned", getattr(result, "id", None),
                    threading.current_thread().name))
    return result


celery.canvas.Signature.apply_async = _recorded_apply_async


@task_received.connect(weak=False)
def _received(request: Any, **_: Any) -> None:
    _events.append((time.perf_counter(), "received", request.id,
                    threading.current_thread().name))


def pytest_runtest_setup(item: Any) -> None:
    _events.clear()


def pytest_runtest_teardown(item: Any) -> None:
    if WATCHED not in item.nodeid or not _events:
        return
    start = _events[0][0]
    with open(LOG, "a") as log:
        log.write(item.nodeid + "\n")
        for at, what, task_id, thread in _events:
            log.write(f"  {1000 * (at - start):8.3f} ms  {what:8s}  {task_id}  {thread}\n")
