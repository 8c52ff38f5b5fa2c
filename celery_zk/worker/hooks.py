"""Celery's worker signals, and what a worker's consuming connection does once.

``worker_init`` (sent once the worker's broker URL is parsed, before its
consumer's first connection) makes :class:`WorkerHooks` the transport's
:data:`celery_zk.broker.transport.worker`; a prefork pool process inherits it.
Never test ``celery.worker.state`` being imported instead: Celery's Django
fix-up imports it in every process that makes an app, so clients (Flower, a web
app calling ``inspect``) would read the kept revokes and patch the pools too.
See ``docs/design.md``, "Module map".
"""
from __future__ import annotations

import os
from typing import Any

from celery.signals import worker_init, worker_shutting_down

from ..broker import queue_expiry
from ..broker import transport as transport_module
from ..broker.slots import SLOTS
from ..compat import celery_pool
from ..features.revokes import load_into_worker
from ..zk.background import give_up_when_cut_off
from .child_gate import backend_handle, stamp, start_in_child
from .start_gate import close_all, start_gate

__all__ = ["WorkerHooks"]


class WorkerHooks:
    """What a Celery worker of this process adds to its zk:// connections."""

    def __init__(self, thread_pool: bool) -> None:
        #: Its pool runs tasks on threads of this process, which end them there too.
        self.thread_pool = thread_pool
        #: The pid and session that loaded the revokes kept in ZooKeeper.
        self._revokes_loaded_by: tuple[int, int] = (0, 0)

    def connection_made(self, transport: Any) -> None:
        """A connection of the worker exists: its prefork children may be handed
        tasks from now on (Celery binds its pool's ``apply_async`` into each
        task's request class when its consumer starts)."""
        self._gate_prefork_children(transport, replace=False)

    def consuming(self, transport: Any) -> None:
        """Before any task is delivered: the revokes kept in ZooKeeper join the
        worker's revoked set (:mod:`celery_zk.features.revokes`), once per process
        and session; its thread pool drops what it has not started when the
        connection is lost and starts a task only while its session is known
        live (:mod:`.start_gate`); the consuming connection stamps prefork
        hand-overs."""
        if not getattr(transport, "_stamps", False):
            transport._stamps = True
            self._gate_prefork_children(transport, replace=True)
        if celery_pool.flush_unstarted_thread_tasks():
            # A pool thread asks before each start whether the session it was
            # delivered under lives (cut off, or back from a pause: start_gate).
            celery_pool.gate_thread_task_starts(start_gate(transport.handle.session))
        client = transport.handle.client
        # Again after a session expiry: the worker may have missed a broadcast
        # revoke meanwhile (its pidbox queue was swept with its holders).
        loaded = (os.getpid(), client.client_id[0] if client.client_id else 0)
        if self._revokes_loaded_by != loaded:
            self._revokes_loaded_by = loaded
            load_into_worker(client, transport.layout)
        queue_expiry.start(transport)   # unused queues go (x-expires)

    def bindings_restored(self, transport: Any) -> None:
        """Broadcasts sent while the connection's bindings were gone (a session
        expiry) reached nobody here; the revokes among them are kept in
        ZooKeeper (the nemesis saw a worker cut off at that moment run 7
        revoked tasks)."""
        load_into_worker(transport.handle.client, transport.layout)

    def tasks_running(self) -> bool:
        """A task of this worker runs on a thread of this process: it stores its
        result through this process's session, and ends (``task_ready``) on its
        own thread. A prefork pool's tasks end on the event loop's thread, the
        one waiting in the shutdown's tidying, so they cannot count: their
        children have sessions of their own."""
        if not self.thread_pool:
            return False
        from celery.worker import state as worker_state

        return bool(worker_state.active_requests)

    @staticmethod
    def _gate_prefork_children(transport: Any, replace: bool) -> None:
        """A prefork child asks whether a task handed to it before a cut-off or
        pause was revoked meanwhile (:mod:`.child_gate`). The stamp is the
        consuming connection's (``replace``, at its first consume), not that of
        a later one that only publishes or asks: ``inspect report`` makes one
        and closes it, and a stamp on its closed handle took a lease of its own
        on the session (another root's would read the wrong revokes)."""
        from celery import current_app

        if backend_handle(current_app, transport.settings.hosts) is None:
            return
        handle, root = transport.handle, transport.layout.root

        def stamped(read_at: float | None) -> tuple[Any, ...]:
            # The parent's gate (and its pause monitor's thread) made at the first
            # hand-over: after the pool forked its children, not before.
            return stamp(start_gate(handle.session), root, read_at)

        celery_pool.hand_prefork_tasks_through(start_in_child, stamped, replace)


@worker_init.connect(weak=False)
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    celery_pool.record_worker(sender)
    pool = getattr(sender, "pool_cls", None)   # a class, or still its name
    if isinstance(pool, str):
        from celery import concurrency
        try:
            pool = concurrency.get_implementation(pool)
        except Exception:   # Celery's own start says what is wrong with it
            pool = None
    # Before Celery's consumer binds the pool's apply_async into its requests.
    celery_pool.track_task_ends(SLOTS)   # a running task holds its concurrency slot
    transport_module.worker = WorkerHooks(
        thread_pool=getattr(pool, "__module__", "") == "celery.concurrency.thread")


@worker_shutting_down.connect(weak=False)
def _on_worker_shutting_down(**_: Any) -> None:
    # Celery runs this inside its SIGTERM/SIGINT handler, which may have
    # interrupted drain_events with a lock held: flag it, take no lock.
    transport_module.shutdown_started()
    queue_expiry.stop_all()
    close_all()   # a pool's stop waits for starts that wait for a server
    # Else the shutdown's tidying waits for the outage to end; not while a task
    # still runs (its result and ack may need the session).
    hooks = transport_module.worker
    give_up_when_cut_off(hooks.tasks_running if hooks is not None else None)
