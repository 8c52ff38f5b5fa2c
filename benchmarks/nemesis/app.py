"""The Celery app of the nemesis: its workers run it, its publisher imports it.

Configured from the environment:

* ``NEMESIS_URL``: broker and result backend (``zk://`` with every member).
* ``NEMESIS_DIR``: where the journals go (:mod:`nemesis.history`).
* ``NEMESIS_HOST``: the worker host this process runs on (its journal's name).
* ``NEMESIS_READY_FILE``: written once the worker consumes.
* ``NEMESIS_DEDUPE``: ``1`` sets ``worker_deduplicate_successful_tasks``.

Every task is ``acks_late`` and records its start and its end, with the
delivery's redelivered flag and the message's node name, before and after
its work: the checker tells a redelivery of one message from a second
message by that name.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from celery import Celery, Task
from common.worker import announce_ready

import celery_zk  # noqa: F401  (registers the zk:// transport alias)

from .history import PUBLISHER, Journal, exec_journal

WORK = "nemesis.work"
BODY = "nemesis.body"

app = Celery("nemesis", broker=os.environ.get("NEMESIS_URL", "zk://127.0.0.1:2181/nemesis"),
             backend=os.environ.get("NEMESIS_URL", "zk://127.0.0.1:2181/nemesis"),
             set_as_current=False)
app.conf.update(
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,   # a worker cut off for minutes keeps trying
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    worker_deduplicate_successful_tasks=os.environ.get("NEMESIS_DEDUPE") == "1",
    worker_prefetch_multiplier=4,
)

_journal: Journal | None = None
#: What the publisher is sending right now (a publish retry is charged to it).
publishing: list[str] = []


def journal() -> Journal:
    """This process's journal: its host's, or the publisher's."""
    global _journal
    if _journal is None:
        host = os.environ.get("NEMESIS_HOST")
        directory = os.environ["NEMESIS_DIR"]
        _journal = Journal(exec_journal(directory, host) if host
                           else os.path.join(directory, PUBLISHER))
    return _journal


def _on_publish_retry(exc: BaseException, interval: float) -> None:
    """kombu calls this before it publishes again after a connection error: if the
    first attempt was stored after all, the task is in the queue twice."""
    from celery import current_task
    during = list(publishing) or ([current_task.request.id] if current_task else [])
    journal().write(e="retry", ids=during, pid=os.getpid(), error=repr(exc)[:300])


app.conf.task_publish_retry_policy = {**app.conf.task_publish_retry_policy,
                                      "errback": _on_publish_retry}


class _RepublishedAfterLostReply(logging.Handler):
    """celery_zk itself publishes again when a publish's reply was lost and the
    message is not found (stored, consumed and acked already, it is a second
    copy): journalled like kombu's retries."""

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("celery_zk: the reply to a"):
            _on_publish_retry(RuntimeError(record.getMessage()), 0.0)


logging.getLogger("celery_zk.broker").addHandler(_RepublishedAfterLostReply(logging.WARNING))


def _record(task: Task, event: str, **extra: Any) -> None:
    request = task.request
    tag = (getattr(request, "properties", None) or {}).get("delivery_tag") or ""
    journal().write(e=event, id=request.id, task=task.name, host=os.environ["NEMESIS_HOST"],
                   pid=os.getpid(), redelivered=bool((request.delivery_info or {})
                                                     .get("redelivered")),
                   tag=tag.rpartition("/")[2], **extra)


@app.task(name=WORK, bind=True)
def work(self: Task, seq: int, ms: int) -> int:
    _record(self, "start", group=self.request.group)
    time.sleep(ms / 1000)
    _record(self, "end")
    return seq


@app.task(name=BODY, bind=True)
def body(self: Task, results: list[int], chord_id: str) -> int:
    """A chord's body: records the parts' results it was given."""
    _record(self, "start", chord=chord_id, results=len(results))
    _record(self, "end")
    return len(results)


if os.environ.get("NEMESIS_HOST"):
    # Per-task lines at INFO would be most of a worker's log; celery_zk's stay.
    for name in ("celery.app.trace", "celery.worker.strategy"):
        logging.getLogger(name).setLevel(logging.WARNING)


announce_ready("NEMESIS_READY_FILE")
