"""kazoo's threading handler, with a ``select`` that notices a silent server.

kazoo waits for its socket to be writable before each write and readable
before each read, so ``select`` (a method of kazoo's handler interface, no
private name) sees when a request goes out and when the server answers: a
write left unanswered for :attr:`PollingHandler.silence` seconds raises
``ConnectionDropped``, and kazoo moves to the next server, the session kept
(ZooKeeper's own client's "have not heard from server"). It waits with one
``poll()``, and reports a socket whose packets wait in the read buffer
(:func:`celery_zk.compat.kazoo.buffer_reads`) readable at once. Why each
matters: docs/design.md, "Waiting: watches, not polling".
"""
from __future__ import annotations

import math
import select
import time
from collections.abc import Sequence
from typing import Any

from kazoo.exceptions import ConnectionDropped
from kazoo.handlers.threading import SequentialThreadingHandler

__all__ = ["PollingHandler"]

_READ = select.POLLIN | select.POLLPRI
_WRITE = select.POLLOUT
#: Reported whatever was asked for: the socket is closed or failed, and the
#: next read or write on it says how (kazoo's epoll-based select does the same).
_TROUBLE = select.POLLERR | select.POLLHUP | select.POLLNVAL
#: While packets wait in the read buffer, the other sockets (kazoo's wake-up
#: for requests to send) are looked at every this many packets: a poll() per
#: packet gave the GIL away once per watch event of a busy consumer's burst.
HELD_PEEK = 8


def _fd(fileobj: Any) -> int:
    return fileobj if isinstance(fileobj, int) else int(fileobj.fileno())


class PollingHandler(SequentialThreadingHandler):
    """:class:`~kazoo.handlers.threading.SequentialThreadingHandler` whose
    ``select`` is one ``poll()`` and drops a connection gone silent."""

    def __init__(self, silence: float | None = None) -> None:
        super().__init__()
        #: Seconds a write may go without a byte from the server before its
        #: connection is taken for dead (None: never). Two thirds of the
        #: session timeout, as in ZooKeeper's client, which leaves a third to
        #: reach another server.
        self.silence = silence
        #: (socket, when): the first write on it since the server was last heard.
        self.asked: tuple[Any, float] | None = None
        #: A socket whose next bytes were read ahead and wait in a buffer (or None).
        self.held: Any = None
        self._held_looks = 0   # looks answered from the buffer in a row (HELD_PEEK)

    def select(self, rlist: Sequence[Any], wlist: Sequence[Any], xlist: Sequence[Any],
               timeout: float | None = None) -> tuple[list[Any], list[Any], list[Any]]:
        if timeout is not None:
            if not isinstance(timeout, (int, float)):
                raise TypeError("timeout must be a number")
            if timeout < 0:
                raise ValueError("timeout must be non-negative")
        held = self.held
        if held is not None and any(f is held for f in rlist):
            # Its packets are here already: the rest without waiting, and only
            # every few packets while the buffer drains.
            self._held_looks += 1
            if not wlist and self._held_looks % HELD_PEEK:
                return [held], [], []
            readable, writable = self._poll([f for f in rlist if f is not held], wlist, 0)
            return [held, *readable], writable, []
        self._held_looks = 0
        asked, overdue = self.asked, False
        if wlist and not rlist:   # kazoo about to write a request or a ping
            if asked is None or asked[0] is not wlist[0]:
                self.asked = (wlist[0], time.monotonic())
        elif asked is not None and self.silence is not None and any(
                f is asked[0] for f in rlist):
            # Wake when it falls due; once due, only what is there already counts
            # (bytes that came while this process itself was paused do).
            left = max(0.0, asked[1] + self.silence - time.monotonic())
            timeout, overdue = (left if timeout is None else min(timeout, left)), left == 0
        readable, writable = self._poll(rlist, wlist, timeout)
        if asked is not None and any(f is asked[0] for f in readable):
            self.heard(asked[0])
        elif overdue:
            self.asked = None
            raise ConnectionDropped(
                f"no reply from the server for {self.silence:.1f}s while requests "
                "waited: taken for dead (a partition?)")
        return readable, writable, []

    def _poll(self, rlist: Sequence[Any], wlist: Sequence[Any],
              timeout: float | None) -> tuple[list[Any], list[Any]]:
        masks: dict[int, int] = {}
        for fileobj in rlist:
            fd = _fd(fileobj)
            masks[fd] = masks.get(fd, 0) | _READ
        for fileobj in wlist:
            fd = _fd(fileobj)
            masks[fd] = masks.get(fd, 0) | _WRITE
        poller = select.poll()
        for fd, mask in masks.items():
            poller.register(fd, mask)
        # Rounded up: a wait of 0.4 ms must not become a busy poll(0).
        wait = None if timeout is None else math.ceil(timeout * 1000)
        ready = dict(poller.poll(wait))
        readable = [f for f in rlist if ready.get(_fd(f), 0) & (_READ | _TROUBLE)]
        writable = [f for f in wlist if ready.get(_fd(f), 0) & (_WRITE | _TROUBLE)]
        return readable, writable

    def heard(self, sock: Any) -> None:
        """Bytes came from ``sock``'s server: what was asked is being answered."""
        asked = self.asked
        if asked is not None and asked[0] is sock:
            self.asked = None

    def wait_readable(self, sock: Any, timeout: float | None) -> bool:
        """Whether ``sock`` itself has bytes (or trouble) within ``timeout`` s,
        whatever is held: for the reader that fills the buffer."""
        return bool(self._poll([sock], (), timeout)[0])
