"""A wake-up that both a blocking ``drain_events`` and Celery's event loop can wait on.

:class:`Waker` is an event and a non-blocking pipe whose read end kombu's
hub polls. Watch callbacks set it on kazoo's threads, so a set must never
block. Why the transport joins Celery's event loop at all: see
``docs/design.md``, "Waiting: watches, not polling".
"""
from __future__ import annotations

import os
import threading
import weakref

__all__ = ["Waker"]


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class Waker:
    """An event that is also readable: ``set`` from any thread, even kazoo's."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._fds: list[int] = []   # [read, write] once an event loop asked for it
        weakref.finalize(self, _close, self._fds)   # the pipe goes with the waker

    def fileno(self) -> int:
        """The read end, for an event loop's ``add_reader`` (made on first use)."""
        if not self._fds:
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._fds += [read, write]
            if self._event.is_set():
                self._poke()
        return self._fds[0]

    def set(self) -> None:
        # Already set: the pipe holds a byte, or clear() is under way and the
        # waiter looks after it. Skipping saves a write (and a GIL hand-off)
        # per watch event and per ack while the waiter is busy delivering.
        if self._event.is_set():
            return
        self._event.set()
        if self._fds:
            self._poke()

    def _poke(self) -> None:
        try:
            os.write(self._fds[1], b"!")
        except (BlockingIOError, IndexError, OSError):
            pass   # full (already readable), or closed meanwhile

    def clear(self) -> None:
        # The pipe first, then the event: a set() between the two finds the
        # event set and writes nothing, and the waiter looks after the clear.
        # The other order could leave the event set with an empty pipe, and
        # every later set() would skip its write: a hub asleep for good.
        if self._fds:
            try:
                while os.read(self._fds[0], 4096):
                    pass
            except (BlockingIOError, IndexError, OSError):
                pass
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)
