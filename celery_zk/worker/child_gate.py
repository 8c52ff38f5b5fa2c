"""A prefork child starts a task handed over around a cut-off or a pause only
if its revoke is not kept in ZooKeeper: a child has no revoked set of its own.

The parent hands every task over through :func:`start_in_child`
(:func:`celery_zk.compat.celery_pool.hand_prefork_tasks_through`), stamped by
:func:`stamp`; the child reads ``revoked/`` only around a disturbance (and for
its first task), on its ``zk://`` result backend's session, never one of its
own. See ``docs/design.md``, "Not starting what may be gone: the start gate".
"""
from __future__ import annotations

import logging
import time
from typing import Any

from ..zk.client import CONNECTION_ERRORS, log_failure
from ..zk.layout import Layout
from ..zk.session import ClientHandle
from .start_gate import StartGate, start_gate

__all__ = ["SETTLE", "backend_handle", "stamp", "start_in_child"]

logger = logging.getLogger(__name__)


def backend_handle(app: Any, hosts: str | None = None) -> ClientHandle | None:
    """The ZooKeeper handle of ``app``'s result backend if it is ``zk://`` (on
    ``hosts``, the broker's ensemble, when given); None otherwise."""
    url = app.conf.result_backend
    if not isinstance(url, str) or not url.startswith("zk"):
        return None   # app.backend not touched: another backend may make a connection
    # celery_zk's backend keeps its handle there (the broker does not import it)
    handle = getattr(app.backend, "_handle", None)
    if isinstance(handle, ClientHandle) and hosts in (None, handle.settings.hosts):
        return handle
    return None


#: Seconds after a disturbance of the parent (reconnected, back from a pause)
#: during which its hand-overs are checked in the child: it reads the
#: broadcasts queued meanwhile within a few event-loop turns.
SETTLE = 5.0


def stamp(parent: StartGate, root: str, read_at: float | None) -> tuple[float, bool, str]:
    """What the parent adds to a hand-over: the time, whether the parent was
    disturbed lately or has no fresh answer from the server (the task's
    message read, ``read_at``, or a round trip, started here if none is under
    way: a busy client can be cut off unnoticed), and the root whose kept
    revokes to read."""
    now = time.time()
    suspect = parent.disturbed_since(now - SETTLE)
    if not parent.fresh(read_at):
        parent.refresh_async()
        suspect = True
    return now, suspect, root


class _Child:
    """This child's view: its session's gate, made at its first task."""

    def __init__(self) -> None:
        self.gate: StartGate | None = None

    def must_look(self, handle: ClientHandle, handed: float) -> bool:
        if self.gate is None:
            self.gate = start_gate(handle.session)
            return True   # the first task: no history before it
        return self.gate.disturbed_since(handed)


_child = _Child()


def start_in_child(tracer: Any, handed: float, suspect: bool, root: str,
                   *args: Any, **kwargs: Any) -> Any:
    """Run in a prefork child in place of Celery's ``tracer``, with its arguments
    (task name, task id, request dict, ...)."""
    from celery import current_app

    app = current_app._get_current_object()
    name, task_id, request = args[0], args[1], args[2]
    handle = backend_handle(app)
    if handle is not None and (_child.must_look(handle, handed) or suspect):
        _refuse_if_revoked(app, handle, root, name, task_id, request)
    return tracer(*args, **kwargs)


def _refuse_if_revoked(app: Any, handle: ClientHandle, root: str, name: str,
                       task_id: str, request: dict[str, Any]) -> None:
    from celery.app.task import Context
    from celery.exceptions import Ignore, Reject
    from celery.worker import state as worker_state

    from ..features.revokes import RevokeStore

    try:
        revoked = RevokeStore(handle.client, Layout(root)).kept(
            task_id, worker_state.REVOKE_EXPIRES)
    except CONNECTION_ERRORS as exc:
        log_failure(logger, exc, "celery_zk: task %s[%s] not started: this worker was cut "
                    "off or paused after it was handed over, and whether it was revoked "
                    "meanwhile cannot be read; it goes back to the queue", name, task_id)
        raise Reject("revoke unknown after a cut-off", requeue=True) from None
    if not revoked:
        return
    logger.warning("celery_zk: task %s[%s] not started: it was revoked while this worker "
                   "was cut off or paused (the revoke is kept in ZooKeeper; a pool process "
                   "has no revoked set of its own)", name, task_id)
    task = app.tasks.get(name)
    if task is not None and (not task.ignore_result or task.store_errors_even_if_ignored):
        task.backend.mark_as_revoked(task_id, "revoked", request=Context(request))
    raise Ignore("revoked while the worker was cut off or paused")
