"""A prefork child starts a task handed over around a cut-off or a pause only
if its revoke is not kept in ZooKeeper.

Celery's prefork parent checks its revoked set when it hands a task to the
pool; a child has no revoked set of its own. When the worker is cut off from
the ensemble or paused, a revoke broadcast meanwhile reaches the parent only
once it is back and has read its pidbox queue, and a task handed over before
that runs in a child (the nemesis saw one run 17 s after its revoke: B12).
The thread pool's :mod:`.start_gate` does not reach a child process.

So the parent hands every task over through :func:`start_in_child`
(:func:`celery_zk.compat.celery.hand_prefork_tasks_through`), stamped by
:func:`stamp` with the time and whether the parent itself was disturbed (not
connected, or cut off, reconnected or paused in the last :data:`SETTLE` s:
its revoked set may lag its pidbox queue), or has had no answer from the
server in the last second (neither the task's message read nor a round
trip of its own, which it then starts: a busy client's connection can be
cut off unnoticed, :mod:`.start_gate`). In the child, a task starts at
once unless the parent said so, or the child's own session (its result
backend's: same host, same network) lost its connection, or the child was
paused, since the hand-over. Then it first reads whether the task's revoke
is kept (``revoked/``, :mod:`celery_zk.features.revokes`): one read, only
around a disturbance (and for a child's first task, which has no history).
A revoked task is stored as ``REVOKED`` and not run; the parent acks it
(Celery's ``Ignore``). A task whose revoke cannot be read is given back to
the queue (``Reject(requeue=True)``).

Only revokes by task id are checked here (the parent still checks stamped
headers), and only in a worker whose result backend is ``zk://`` on the
broker's ensemble: a child has no ZooKeeper session otherwise, and one per
child only for this would count against ``maxClientCnxns``.
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
