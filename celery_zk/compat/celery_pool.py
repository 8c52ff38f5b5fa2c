"""Celery's worker pools: the private names celery_zk uses around them
(Celery 5.3 to 5.7; :mod:`celery_zk.compat.celery` has the rest of Celery's).

* **Thread pool flush**, ``celery.concurrency.thread.TaskPool`` (its
  ``on_apply`` returning an ``ApplyResult`` whose ``f`` is the
  ``concurrent.futures`` future): when the broker connection is lost Celery
  calls ``pool.flush()`` to drop tasks handed to the pool and not started
  (their messages go to other workers, and their acks could not be sent).
  prefork does that; the thread pool's ``flush`` does nothing, so such a task
  ran later anyway, after its redelivery elsewhere and even after a revoke the
  worker learnt on reconnecting (the nemesis found it).
  :func:`flush_unstarted_thread_tasks` gives it a ``flush`` that cancels the
  futures not yet running. Fallback: Celery's behaviour, with a warning.
  Celery calls ``flush`` only once its consumer has noticed the lost
  connection, and a pool thread freed meanwhile may start one more (the
  nemesis saw a revoked task start in those 0.6 s), so the transport also
  calls :func:`drop_unstarted_thread_tasks` the instant its session is lost.
  A task a pool thread takes up while the worker is cut off or just back from
  a pause is asked about at its start instead (:func:`gate_thread_task_starts`,
  :mod:`celery_zk.worker.start_gate`): that relies on ``on_apply``'s
  parameters (:data:`ON_APPLY_PARAMETERS`) and on ``apply_target`` calling
  ``accept_callback`` before the task, outside its ``try``; a start refused
  there ends ``apply_target`` before the task, as a cancelled future would.
  The gate is told the message's delivery tag, read from the ``Request``
  whose bound ``on_accepted`` Celery passes as ``accept_callback`` (its
  ``message`` property): which registration, so which session, the message
  was delivered to. Fallback: the session the task is handed over under.
  The same wrapper asks ``Request.revoked()`` again right before the start,
  as Celery does when it hands the task over: a revoke that came while the
  task waited behind others in the pool is honoured.
* **Pool size**, ``WorkController.pool`` (set by the worker's ``Pool``
  bootstep) and its ``num_processes`` (``BasePool``'s, ``limit``; prefork's
  counts the processes, so autoscaling shows): how many tasks the worker of
  this process runs at once (:func:`pool_slots`). A consumer keeps its
  hand-off offer while one of them is free. Fallback: the worker's
  ``concurrency``, else 1 (an offer only while nothing is in hand).
* **Prefork hand-over**, ``celery.concurrency.prefork.TaskPool.apply_async``
  (``BasePool``'s, not overridden) and the arguments
  ``Request.execute_using_pool`` passes Celery's tracer (task name, task id,
  request dict, body, ...): a child that already holds a task runs it after
  a revoke the parent heard too late (docs/nemesis.md, B12).
  :func:`hand_prefork_tasks_through` makes a child call a starter of ours,
  told what the parent knew at the hand-over, in place of the tracer, and the
  starter calls the tracer (:mod:`celery_zk.worker.child_gate`); the starter
  is pickled by reference as the tracer is. Celery binds the pool's
  ``apply_async`` into each task's request class when its consumer starts,
  so this is installed with the worker's first connection. Fallback: no
  check in children, with a warning.
* **Task ends**, ``celery.concurrency.base.BasePool.apply_async`` (both
  pools' own; its ``accept_callback``, ``callback`` and ``error_callback``
  options): :func:`track_task_ends` tells a listener when each task is
  accepted by the pool (Celery acks an early-ack task there) and when it
  ends (success, failure, revoke, a lost pool process), in the worker's main
  process for prefork and in the pool thread for threads: a cluster-wide
  concurrency slot is held from a task's start to its end whatever its ack
  mode (:mod:`celery_zk.broker.slots`). billiard may report a task's end
  before its acceptance; the listener is told in that order then. Installed
  at ``worker_init``, before Celery binds the pool's ``apply_async`` into its
  request classes. Fallback: a slot is held only until the ack, with a
  warning.
"""
from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from .celery import _changed

__all__ = ["READ_AT", "StartRefused", "TaskEnds", "drop_unstarted_thread_tasks",
           "flush_unstarted_thread_tasks", "gate_thread_task_starts",
           "hand_prefork_tasks_through", "missing", "pool_slots", "record_worker",
           "track_task_ends"]

logger = logging.getLogger(__name__)

#: The leading parameters of the thread pool's ``on_apply`` the start gate relies on.
ON_APPLY_PARAMETERS = ["self", "target", "args", "kwargs", "callback", "accept_callback"]
#: The parameters of ``BasePool.apply_async`` the task-end hook relies on.
APPLY_ASYNC_PARAMETERS = ["self", "target", "args", "kwargs", "options"]


def _thread_pool_problem() -> str | None:
    from celery.concurrency import base, thread

    pool = getattr(thread, "TaskPool", None)
    if pool is None or not callable(getattr(pool, "on_apply", None)):
        return "celery.concurrency.thread.TaskPool.on_apply"
    if list(inspect.signature(pool.on_apply).parameters)[:6] != ON_APPLY_PARAMETERS:
        return f"celery.concurrency.thread.TaskPool.on_apply({', '.join(ON_APPLY_PARAMETERS)})"
    if not callable(getattr(thread, "ApplyResult", None)):
        return "celery.concurrency.thread.ApplyResult"
    if not callable(getattr(base.BasePool, "flush", None)):
        return "celery.concurrency.base.BasePool.flush"
    from celery.worker.request import Request
    if not (callable(getattr(Request, "on_accepted", None))
            and callable(getattr(Request, "revoked", None))
            and isinstance(getattr(Request, "message", None), property)):
        return "celery.worker.request.Request.on_accepted, .revoked and .message"
    return None


#: The thread pools of this process whose unstarted tasks are tracked.
_thread_pools: weakref.WeakSet[Any] = weakref.WeakSet()


class StartGate(Protocol):
    """What decides whether a task handed to a thread pool may start."""

    def ticket(self, delivery_tag: str | None) -> Any:
        """Taken when the task is handed over (in the consumer's thread), with
        its message's delivery tag when Celery's request shows it."""

    def admit(self, ticket: Any, read_at: float | None = None) -> bool:
        """Asked in the pool thread right before the task starts, with the time
        its message was read (monotonic, :data:`READ_AT`); may block."""


class StartRefused(Exception):
    """Ends Celery's ``apply_target`` before the task (nobody reads it: the
    future is dropped, as a cancelled one would be)."""


#: The gate of this process's thread pools (None: every task starts).
_start_gate: StartGate | None = None


def gate_thread_task_starts(gate: StartGate | None) -> None:
    """Ask ``gate`` before each task a thread pool of this process starts
    (:func:`flush_unstarted_thread_tasks` installs the hook)."""
    global _start_gate
    _start_gate = gate


#: The message property the zk transport sets to when it read the message
#: (``time.monotonic()`` in the delivering process): the start gates read it.
READ_AT = "celery_zk_read_at"


def _read_at(request: Any) -> float | None:
    """When the message of a Celery ``Request`` was read (``READ_AT``); None if unknown."""
    properties = getattr(getattr(request, "message", None), "properties", None)
    read_at = properties.get(READ_AT) if isinstance(properties, dict) else None
    return read_at if isinstance(read_at, float) else None


def _delivery_tag(request: Any) -> str | None:
    """The delivery tag of a Celery ``Request`` (``request.message``, a kombu
    Message); None for anything else."""
    tag = getattr(getattr(request, "message", None), "delivery_tag", None)
    return tag if isinstance(tag, str) else None


def _gated(gate: StartGate, accept: Callable[..., Any] | None) -> Callable[..., Any]:
    # Celery passes its Request's bound on_accepted: the request, its message.
    request = getattr(accept, "__self__", None)
    ticket, read_at = gate.ticket(_delivery_tag(request)), _read_at(request)

    def accept_if_admitted(pid: Any, time_accepted: float) -> Any:
        if not gate.admit(ticket, read_at):
            logger.warning("celery_zk: task %s[%s] not started: it was delivered under a "
                           "ZooKeeper session that has ended; its message went back to "
                           "the queue", getattr(request, "name", "?"),
                           getattr(request, "id", "?"))
            raise StartRefused("delivered under a ZooKeeper session that has ended")
        revoked = getattr(request, "revoked", None)
        if callable(revoked) and revoked():
            # Revoked (or expired) while it waited in the pool: Celery looked only
            # when it handed the task over. revoked() acks it and stores REVOKED.
            raise StartRefused("revoked while it waited in the thread pool")
        return accept(pid, time_accepted) if accept else None

    return accept_if_admitted


def drop_unstarted_thread_tasks() -> int:
    """Cancel what every thread pool of this process has not started (the
    broker session they were delivered under is gone); how many. Never blocks:
    safe on kazoo's event thread."""
    return sum(pool.flush() or 0 for pool in list(_thread_pools))


def flush_unstarted_thread_tasks() -> bool:
    """Give Celery's thread pool a ``flush`` that cancels the tasks it has not
    started (idempotent; see above). False, Celery's left as it is, when its
    thread pool is not the one this was written against or flushes itself."""
    from concurrent.futures import Future

    from celery.concurrency import base, thread

    problem = _thread_pool_problem()
    if problem is not None:
        logger.warning("%s", _changed(
            problem, "to drop the tasks a thread pool has not started when the broker "
            "connection is lost", "Such tasks run after their redelivery elsewhere."))
        return False
    pool = thread.TaskPool
    if getattr(pool.flush, "_celery_zk", False):
        return True
    if pool.flush is not base.BasePool.flush:
        return False   # Celery's own flush
    original = pool.on_apply

    def on_apply(self: Any, target: Any, args: Any = None, kwargs: Any = None,
                 callback: Any = None, accept_callback: Any = None, **options: Any) -> Any:
        gate = _start_gate
        if gate is not None:
            accept_callback = _gated(gate, accept_callback)
        result = original(self, target, args, kwargs, callback, accept_callback, **options)
        future = getattr(result, "f", None)
        if isinstance(future, Future):
            _thread_pools.add(self)
            unstarted = self.__dict__.setdefault("_celery_zk_unstarted", set())
            unstarted.add(future)   # set.add/discard: atomic, any thread
            future.add_done_callback(unstarted.discard)
        return result

    def flush(self: Any) -> int:
        dropped = sum(future.cancel()   # False once it runs: it is left to finish
                      for future in list(self.__dict__.get("_celery_zk_unstarted", ())))
        if dropped:
            logger.warning("celery_zk: the broker connection was lost: %d task(s) the "
                           "thread pool had not started are dropped; their messages go "
                           "to other workers (or here again)", dropped)
        return dropped

    flush._celery_zk = True  # type: ignore[attr-defined]
    on_apply.__wrapped__ = original  # type: ignore[attr-defined]
    pool.on_apply = on_apply
    pool.flush = flush
    return True


def hand_prefork_tasks_through(starter: Callable[..., Any],
                               stamp: Callable[[float | None], tuple[Any, ...]],
                               replace: bool = True) -> bool:
    """Make prefork children call ``starter(tracer, *stamp(read_at), *tracer_args)``
    in place of Celery's tracer (``stamp`` runs in the parent at the hand-over,
    told when the task's message was read, :data:`READ_AT`). Idempotent: a
    later call's ``stamp`` replaces the installed one only with ``replace``.
    False, nothing changed, when this Celery's prefork pool is not the one this
    was written against."""
    from celery.concurrency import base, prefork

    global _prefork_stamp
    pool = prefork.TaskPool
    if getattr(pool.apply_async, "_celery_zk", False):
        if replace or _prefork_stamp is None:
            _prefork_stamp = stamp
        return True
    problem = _prefork_problem()
    if problem is not None:
        logger.warning("%s", _changed(problem, *_PREFORK_HAND_OVER))
        return False
    original = base.BasePool.apply_async
    _prefork_stamp = stamp

    def apply_async(self: Any, target: Any, args: Any = None, kwargs: Any = None,
                    **options: Any) -> Any:
        # (task name, task id, request dict, ...): Celery's tracer; anything else as it is
        stamped = _prefork_stamp
        if (stamped is not None and isinstance(args, (tuple, list)) and len(args) >= 3
                and isinstance(args[2], dict)):
            # Celery passes its Request's bound on_accepted: the request, its message.
            request = getattr(options.get("accept_callback"), "__self__", None)
            args = (target, *stamped(_read_at(request)), *args)
            target = starter
        return original(self, target, args, kwargs, **options)

    apply_async._celery_zk = True  # type: ignore[attr-defined]
    apply_async.__wrapped__ = original  # type: ignore[attr-defined]
    pool.apply_async = apply_async
    return True


#: What the prefork hand-over is used for, and what is lost without it (its warnings).
_PREFORK_HAND_OVER = ("to check, in a prefork child, the revokes of tasks handed over while "
                      "the worker was cut off or paused", "Such a task may run after its revoke.")


def _prefork_problem() -> str | None:
    """What differs from the prefork hand-over :func:`hand_prefork_tasks_through`
    relies on; None if nothing."""
    from celery.app import trace
    from celery.concurrency import base, prefork

    apply_async = prefork.TaskPool.apply_async
    if not (apply_async is base.BasePool.apply_async or getattr(apply_async, "_celery_zk", False)):
        return "celery.concurrency.prefork.TaskPool overrides apply_async"
    for name, first in (("fast_trace_task", ["task", "uuid", "request"]),
                        ("trace_task_ret", ["name", "uuid", "request"])):
        tracer = getattr(trace, name, None)
        if not callable(tracer) or list(inspect.signature(tracer).parameters)[:3] != first:
            return f"celery.app.trace.{name}({', '.join(first)}, ...)"
    return None


#: What the parent adds to each prefork hand-over (hand_prefork_tasks_through).
_prefork_stamp: Callable[[float | None], tuple[Any, ...]] | None = None


#: The Celery worker (WorkController) of this process, once it has started.
_worker: Callable[[], Any] | None = None


def record_worker(worker: Any) -> None:
    """Remember ``worker`` (``worker_init``'s sender), weakly, for :func:`pool_slots`."""
    global _worker
    try:
        _worker = weakref.ref(worker)
    except TypeError:
        _worker = None


def pool_slots() -> int:
    """How many tasks this process's Celery worker runs at once; 1 outside a worker."""
    worker = _worker() if _worker is not None else None
    if worker is None:
        return 1
    for value in (getattr(getattr(worker, "pool", None), "num_processes", None),
                  getattr(worker, "concurrency", None)):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 1


class TaskEnds(Protocol):
    """Told, by delivery tag, when a task is accepted by the pool and when it
    ends; asked first whether it wants to be told of that task at all."""

    def wants(self, delivery_tag: str) -> bool: ...

    def accepted(self, delivery_tag: str) -> None: ...

    def ended(self, delivery_tag: str) -> None: ...


#: The listener of this process's pools (track_task_ends).
_task_ends: TaskEnds | None = None
#: What task ends are used for, and what is lost without them (their warnings).
_TASK_ENDS = ("to hold a task's concurrency slot until it ends", "A task that acks early "
              "holds its slot of a cluster-wide concurrency limit only until its ack.")


def _apply_async_problem() -> str | None:
    from celery.concurrency import base

    original = base.BasePool.apply_async
    original = getattr(original, "__wrapped__", original) if getattr(
        original, "_celery_zk_ends", False) else original
    if list(inspect.signature(original).parameters) != APPLY_ASYNC_PARAMETERS:
        return ("celery.concurrency.base.BasePool.apply_async"
                f"({', '.join(APPLY_ASYNC_PARAMETERS[:-1])}, **options)")
    return None


def track_task_ends(ends: TaskEnds) -> bool:
    """Tell ``ends`` when each task of this process's pools is accepted and
    when it ends (see above; idempotent, the last listener is told). False,
    Celery's left as it is, when its pools are not the ones this was written
    against."""
    from celery.concurrency import base

    global _task_ends
    _task_ends = ends
    if getattr(base.BasePool.apply_async, "_celery_zk_ends", False):
        return True
    problem = _apply_async_problem()
    if problem is not None:
        logger.warning("%s", _changed(problem, *_TASK_ENDS))
        return False
    original = base.BasePool.apply_async

    def apply_async(self: Any, target: Any, args: Any = None, kwargs: Any = None,
                    **options: Any) -> Any:
        # Celery passes its Request's bound on_accepted: the request, its message.
        tag = _delivery_tag(getattr(options.get("accept_callback"), "__self__", None))
        listener = _task_ends
        if tag is not None and listener is not None and listener.wants(tag):
            options["accept_callback"] = _First(listener.accepted, tag,
                                                options.get("accept_callback"))
            for key in ("callback", "error_callback"):
                options[key] = _First(listener.ended, tag, options.get(key))
        return original(self, target, args, kwargs, **options)

    apply_async._celery_zk_ends = True  # type: ignore[attr-defined]
    apply_async.__wrapped__ = original  # type: ignore[attr-defined]
    base.BasePool.apply_async = apply_async
    return True


class _First:
    """``then`` (a callback Celery passes), after telling ``tell`` the tag. It
    keeps ``then``'s ``__self__``: the hooks above find the Request there."""

    def __init__(self, tell: Callable[[str], None], tag: str,
                 then: Callable[..., Any] | None) -> None:
        self.tell, self.tag, self.then = tell, tag, then
        self.__self__ = getattr(then, "__self__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.tell(self.tag)
        return self.then(*args, **kwargs) if self.then is not None else None


def missing() -> list[str]:
    """What the installed Celery lacks of the names above, one message each."""
    from celery.concurrency import base as pool_base

    problems = []
    problem = _thread_pool_problem()
    if problem is not None:
        problems.append(str(_changed(problem, "to drop a thread pool's unstarted tasks on "
                                     "a lost connection", "They run after redelivery.")))
    if not isinstance(getattr(pool_base.BasePool, "num_processes", None), property):
        problems.append(str(_changed("celery.concurrency.base.BasePool.num_processes",
                                     "to know when a worker has a free pool slot",
                                     "A worker offers to take a handed message only while "
                                     "it holds none.")))
    problem = _prefork_problem()
    if problem is not None:
        problems.append(str(_changed(problem, *_PREFORK_HAND_OVER)))
    problem = _apply_async_problem()
    if problem is not None:
        problems.append(str(_changed(problem, *_TASK_ENDS)))
    return problems
