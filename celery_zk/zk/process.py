"""This process's id, without a system call each time it is asked.

What a parent process leaves to a forked child (a ZooKeeper session, a
registration, a thread) must not be used there, so objects compare the pid
they were made in with the current one on every use: on every delivery, in a
worker. ``os.getpid()`` is a system call each time (about 0.2 µs, and it
holds the GIL); a prefork worker's parent spent about 5% of its GIL time in
those checks. The id is read once, and again in every child forked through
Python: ``os.fork`` runs the ``register_at_fork`` hooks, and billiard and
multiprocessing fork through it.
"""
from __future__ import annotations

import os

__all__ = ["current_pid"]

_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def current_pid() -> int:
    """``os.getpid()``, read at import and after each fork."""
    return _pid
