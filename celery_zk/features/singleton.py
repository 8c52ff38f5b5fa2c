"""Singleton tasks on a session-bound lock: no TTL, released when the holder dies.

The lock is an ephemeral node ``locks/{key}`` of the worker process's
session on the broker (``app.pool``): created before the task body runs and
deleted when it returns or raises, and by ZooKeeper when the process dies,
never before. A second call fails with :class:`LockHeld` (at once, or after
``lock_wait``); the node's ``czxid`` is the fencing token. See
``docs/features.md``, "Singleton tasks on a session-bound lock".
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from celery import Task
from kazoo.exceptions import NodeExistsError, NoNodeError

from ..exceptions import CeleryZKError
from ..zk.client import delete_if_there
from ..zk.layout import Layout

__all__ = ["LockHeld", "Singleton", "TaskLock"]


class LockHeld(CeleryZKError):
    """Another run of a singleton task holds its lock."""


# Celery stores a task's exception by module and name: name the public path,
# which stays when this module moves.
LockHeld.__module__ = "celery_zk"


@dataclass(frozen=True)
class TaskLock:
    """The lock a running singleton task holds."""

    key: str
    path: str
    token: int        # the lock node's czxid: a fencing token
    session_id: int   # the ZooKeeper session that owns it


class Singleton(Task):
    """A task that runs at most once at a time per lock key (see the module)."""

    #: ``str.format`` template over the call's args and kwargs; default: the task name.
    lock_key: str | None = None
    #: Seconds a call waits for a held lock before it fails with LockHeld.
    lock_wait: float = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = self.lock_key_for(args, kwargs)
        with self.app.pool.acquire(block=True) as connection:
            transport = connection.transport
            if not hasattr(transport, "handle"):
                raise CeleryZKError(
                    f"task {self.name!r} is a celery_zk Singleton, whose lock lives in "
                    "ZooKeeper: the broker must be zk:// (it is "
                    f"{connection.transport_cls!r})")
            connection.connect()   # a no-op once the pooled connection is up
            client, layout = transport.handle.client, transport.layout
            lock = self._acquire(client, layout, key)
            previous = getattr(self.request, "zk_lock", None)
            self.request.zk_lock = lock
            try:
                # As Celery's tracer calls a task without a __call__ of its own:
                # its request (id, retries...) is the one the worker pushed.
                return self.run(*args, **kwargs)
            finally:
                self.request.zk_lock = previous
                # Its session ended: ZooKeeper released it already
                delete_if_there(client, lock.path)

    def lock_key_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        template = self.lock_key or self.name
        try:
            key = template.format(*args, **kwargs)
        except (IndexError, KeyError) as exc:
            raise CeleryZKError(
                f"lock_key {template!r} of task {self.name!r} names {exc} that this call "
                f"does not have (args {args!r}, kwargs {sorted(kwargs)})") from None
        if not key:
            raise CeleryZKError(f"lock_key of task {self.name!r} formats to an empty key")
        return key

    @property
    def lock(self) -> TaskLock:
        """The lock this run holds (its ``token`` is the fencing token)."""
        lock = getattr(self.request, "zk_lock", None)
        if lock is None:
            raise CeleryZKError(f"task {self.name!r} holds no lock outside its run")
        return lock

    def lock_held(self) -> bool:
        """Still this run's lock: the node exists, is the one it created, and its
        session is the current one (False after the session expired)."""
        lock = self.lock
        with self.app.pool.acquire(block=True) as connection:
            connection.connect()
            client = connection.transport.handle.client
            try:
                stat = client.retry(client.exists, lock.path)
            except Exception:
                return False
            return (stat is not None and stat.czxid == lock.token
                    and stat.ephemeralOwner == lock.session_id
                    and client.client_id is not None and client.client_id[0] == lock.session_id)

    def _acquire(self, client: Any, layout: Layout, key: str) -> TaskLock:
        path = layout.lock(key)
        data = json.dumps({"task_id": self.request.id, "task": self.name,
                           "host": socket.gethostname(), "pid": os.getpid(),
                           "at": time.time()}).encode()
        deadline = time.monotonic() + max(0.0, float(self.lock_wait))
        while True:
            try:
                client.retry(client.create, path, data, ephemeral=True, makepath=True)
                stat = client.retry(client.exists, path)
                if stat is not None and stat.ephemeralOwner == client.client_id[0]:
                    return TaskLock(key, path, stat.czxid, stat.ephemeralOwner)
                continue   # gone again already (our session ended): try again
            except NodeExistsError:
                pass
            released = threading.Event()
            try:
                # The watch only sets a flag (kazoo's thread must never block).
                holder, _ = client.retry(client.get, path,
                                         watch=lambda event, flag=released: flag.set())
            except NoNodeError:
                continue   # released between our create and our look
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not released.wait(remaining):
                raise LockHeld(_held_message(self.name, key, holder, self.lock_wait))


def _held_message(task: str, key: str, holder: bytes, waited: float) -> str:
    try:
        who = json.loads(holder)
        by = (f"task {who.get('task_id')} on {who.get('host')} (pid {who.get('pid')}), "
              f"since {time.strftime('%H:%M:%S', time.localtime(who.get('at', 0)))}")
    except (ValueError, AttributeError):
        by = "another run"
    after = f" after waiting {waited:g} s" if waited else ""
    return (f"task {task!r} did not run{after}: its lock {key!r} is held by {by}. "
            "It is released when that run ends, or when its worker dies (after the "
            "session timeout).")
