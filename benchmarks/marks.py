"""The timeline's marks: timestamps taken at celery_zk's transport and backend steps.

:func:`install` wraps the methods of each step from the outside, so that every
call records a mark (``time.perf_counter``, the step's name) in this process;
:func:`dump` appends them to a file that ``timeline.py`` reads. A worker started
with ``BENCH_TIMELINE_FILE`` set installs them through bench_app
(:func:`install_in_worker`) and writes its marks at shutdown.
"""
from __future__ import annotations

import functools
import os
import time
from typing import Any

#: Set in the worker's environment: where its hooks write their marks.
ENV_FILE = "BENCH_TIMELINE_FILE"

_marks: list[tuple[float, str]] = []


def mark(step: str) -> None:
    _marks.append((time.perf_counter(), step))


def install() -> None:
    """Wrap the transport's steps so each call records the first mark it passes."""
    from celery_zk.backend import backend, result_consumer
    from celery_zk.broker import channel, dispatcher, handoff, inbox
    from celery_zk.compat import kazoo as kazoo_compat

    def wrap(cls: Any, name: str, step: str, after: str | None = None) -> None:
        inner = getattr(cls, name)

        @functools.wraps(inner)
        def marked(*args: Any, **kwargs: Any) -> Any:
            mark(step)
            result = inner(*args, **kwargs)
            if after:
                mark(after)
            return result
        setattr(cls, name, marked)

    # Not the returns of writes (timeline.py's STEPS say why): no marks after them.
    wrap(channel.Channel, "_put", "put")
    wrap(handoff.HandOff, "give", "give")
    # _write returns once the socket took the request, long before its reply:
    # where the client's own part of a publish ends.
    wrap(kazoo_compat._DirectRequests, "_write", "write", "sent")
    wrap(dispatcher.Dispatcher, "_give", "dispatch")
    wrap(inbox.Inbox, "_on_tree", "tree")
    wrap(channel.Channel, "_get", "get")
    wrap(inbox.Inbox, "_learn", "learn", "read")
    take = inbox.Inbox.take

    @functools.wraps(take)
    def marked_take(self: Any) -> Any:
        claimed = take(self)
        if claimed is not None:   # also called to find nothing there
            mark("take")
        return claimed
    inbox.Inbox.take = marked_take  # type: ignore[method-assign]
    wrap(backend.ZooKeeperBackend, "_store_result", "store", "stored-result")
    wrap(result_consumer.ResultConsumer, "_on_watch", "watch")


def dump(path: str, role: str) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.writelines(f"{ts:.7f} {role} {step}\n" for ts, step in _marks)
    _marks.clear()


def install_in_worker() -> None:
    """Called by bench_app when ``BENCH_TIMELINE_FILE`` is set."""
    from celery.signals import task_prerun, worker_shutdown

    path = os.environ[ENV_FILE]
    install()
    task_prerun.connect(lambda **_: mark("task"), weak=False)
    worker_shutdown.connect(lambda **_: dump(path, "worker"), weak=False)
