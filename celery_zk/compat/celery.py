"""Celery's private names that celery_zk uses (Celery 5.3 to 5.7).

* **Group publishing**, ``group._apply_tasks``: Celery has no hook for "a
  group is being published", so :mod:`celery_zk.broker.groups` wraps this
  generator to store a group's messages a few hundred per multi. Fallback:
  each task is published on its own, as on every other broker.
* **Lazy headers**, ``celery.utils.functional._regen``: the type Celery keeps
  a group's or chord header's tasks in when they were given as a generator;
  those are published (and counted) as they come, never held. Fallback:
  anything but a plain list or tuple counts as lazy.
* **URL masking**, ``celery.app.utils.sanitize_url`` (Celery 5.7) or the
  ``maybe_sanitize_url`` it imported from kombu before: ``celery report`` and
  ``app.conf.humanize()`` mask result backend URLs through it, and celery_zk
  masks the passwords a ``zk://`` URL keeps in its query too. Fallback:
  Celery's own masking (the ``user:password@`` part only), with a warning.
* **Backend hooks**: what a key/value result backend overrides or reads of
  Celery's base classes (:data:`BACKEND_HOOKS`), as Celery's own Redis backend
  does. No fallback: checked by the tests, and named by the error if gone.
* **Waiters by task id** (celery#4925): before Celery 5.7 the backend's
  ``_pending_results`` holds one result object per task id, and *any* object
  of that id being garbage-collected (a copy Celery made and dropped while
  publishing a group) removes the waiter, whose ``get()`` then hangs.
  :func:`is_stray_copy` tells such a copy by the map's shape (Celery 5.7
  keeps every waiter and fixed it itself).
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
"""
from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from . import PrivateAPIChanged, describe

__all__ = ["BACKEND_HOOKS", "READ_AT", "StartRefused", "drop_unstarted_thread_tasks",
           "flush_unstarted_thread_tasks", "gate_thread_task_starts",
           "hand_prefork_tasks_through", "is_lazy",
           "is_stray_copy", "missing", "pool_slots", "record_worker", "wrap_group_apply_tasks",
           "wrap_url_masking"]

logger = logging.getLogger(__name__)

#: The leading parameters of ``group._apply_tasks`` the group wrapper relies on.
APPLY_TASKS_PARAMETERS = ["self", "tasks", "producer", "app"]

#: The leading parameters of the thread pool's ``on_apply`` the start gate relies on.
ON_APPLY_PARAMETERS = ["self", "target", "args", "kwargs", "callback", "accept_callback"]

#: The names of ``celery.app.utils`` Celery has masked URLs with, newest first.
URL_MASKERS = ("sanitize_url", "maybe_sanitize_url")

#: ``(module, class, name)`` of each base-class member ZooKeeperBackend
#: overrides or reads (``celery_zk/backend/backend.py``).
BACKEND_HOOKS: tuple[tuple[str, str, str], ...] = (
    ("celery.backends.base", "BaseKeyValueStoreBackend", "_apply_chord_incr"),
    ("celery.backends.base", "BaseKeyValueStoreBackend", "_store_result"),
    ("celery.backends.base", "BaseBackend", "_get_result_meta"),
    ("celery.backends.base", "BaseBackend", "set_chord_size"),
    ("celery.backends.base", "BaseBackend", "add_to_chord"),
)
#: Set by ``BaseBackend.__init__``; a result consumer is given the first two.
BACKEND_INSTANCE = ("_pending_results", "_pending_messages", "_cache")


def _changed(name: str, used_for: str, consequence: str) -> PrivateAPIChanged:
    return PrivateAPIChanged(describe("celery", name, used_for, consequence))


def _group_apply_tasks() -> Any:
    from celery.canvas import group

    return getattr(group, "_apply_tasks", None)


def _apply_tasks_problem(original: Any) -> str | None:
    if original is None:
        return "group._apply_tasks"
    if getattr(original, "_celery_zk", False):
        original = original.__wrapped__
    if (not inspect.isgeneratorfunction(original)
            or list(inspect.signature(original).parameters)[:4] != APPLY_TASKS_PARAMETERS):
        return f"group._apply_tasks({', '.join(APPLY_TASKS_PARAMETERS)}, ...) as a generator"
    return None


def wrap_group_apply_tasks(make: Callable[[Any], Callable[..., Any]]) -> bool:
    """Replace ``group._apply_tasks`` by ``make(original)`` (once); False, and
    Celery's left as it is, when it is not the one this was written against."""
    from celery.canvas import group

    original = _group_apply_tasks()
    if getattr(original, "_celery_zk", False):
        return True
    problem = _apply_tasks_problem(original)
    if problem is not None:
        logger.warning("%s", _changed(problem, "to store a group's messages together",
                                      "Groups are published task by task."))
        return False
    wrapper = make(original)
    wrapper._celery_zk = True  # type: ignore[attr-defined]
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    group._apply_tasks = wrapper
    return True


def is_lazy(tasks: Any) -> bool:
    """Whether a group's tasks (or a header's frozen results) come from a
    generator, to be consumed as they come."""
    from celery.utils import functional

    lazy_type = getattr(functional, "_regen", None)
    if isinstance(lazy_type, type):
        return isinstance(tasks, lazy_type)
    return type(tasks) not in (list, tuple)


def wrap_url_masking(hide: Callable[[str], str], schemes: frozenset[str]) -> bool:
    """Make Celery mask URLs of ``schemes`` with ``hide`` (idempotent); False
    when Celery masks with neither name of :data:`URL_MASKERS`."""
    try:
        from celery.app import utils
    except ImportError:
        return False
    for name in URL_MASKERS:
        celery_mask = getattr(utils, name, None)
        if callable(celery_mask):
            break
    else:
        logger.warning("%s", _changed(
            f"celery.app.utils.{' or '.join(URL_MASKERS)}",
            "to mask the passwords of zk:// URL options in `celery report`",
            "Celery's own masking hides only the user:password@ part."))
        return False
    if getattr(celery_mask, "_celery_zk", False):
        return True

    def masked(url: Any, mask: str = "*" * 8) -> Any:   # Celery passes mask=
        if isinstance(url, str) and url.partition("://")[0] in schemes:
            return hide(url)
        return celery_mask(url, mask=mask)

    masked._celery_zk = True  # type: ignore[attr-defined]
    setattr(utils, name, masked)
    return True


def _thread_pool_problem() -> str | None:
    try:
        from celery.concurrency import base, thread
    except ImportError:   # pragma: no cover - every supported Celery has it
        return "celery.concurrency.thread.TaskPool"
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

    on_apply._celery_zk = True  # type: ignore[attr-defined]
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
    import inspect

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


def is_stray_copy(pending_results: Any, result: Any) -> bool:
    """Whether ``result`` is not the object waiting on its task id in a pending
    map that holds one object per id (Celery before 5.7; see above)."""
    for mapping in pending_results:
        registered = mapping.get(result.id)
        if registered is not None and hasattr(registered, "id"):   # one object, not a dict
            return registered is not result
    return False


def missing(backend: Any = None) -> list[str]:
    """What the installed Celery lacks of the names above, one message each (with
    ``backend``, a ZooKeeperBackend instance, its base's attributes too)."""
    import importlib

    from celery.app import utils
    from celery.concurrency import base as pool_base
    from celery.utils import functional

    problems = []
    problem = _apply_tasks_problem(_group_apply_tasks())
    if problem is not None:
        problems.append(str(_changed(problem, "to store a group's messages together",
                                     "Groups are published task by task.")))
    if not isinstance(getattr(functional, "_regen", None), type):
        problems.append(str(_changed("celery.utils.functional._regen",
                                     "to tell generator headers from lists",
                                     "Anything but a list or tuple counts as a generator.")))
    if not any(callable(getattr(utils, name, None)) for name in URL_MASKERS):
        problems.append(str(_changed(f"celery.app.utils.{' or '.join(URL_MASKERS)}",
                                     "to mask zk:// URL options in reports",
                                     "Only user:password@ is masked.")))
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
    for module, cls, name in BACKEND_HOOKS:
        owner = getattr(importlib.import_module(module), cls, None)
        if not callable(getattr(owner, name, None)):
            problems.append(str(_changed(f"{cls}.{name}", "as a result backend",
                                         "The zk:// result backend cannot work.")))
    if backend is not None:
        problems += [str(_changed(f"BaseBackend().{name}", "as a result backend",
                                  "The zk:// result backend cannot work."))
                     for name in BACKEND_INSTANCE if not hasattr(backend, name)]
    return problems
