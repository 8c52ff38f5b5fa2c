"""kazoo's threading handler, waiting on its sockets with ``poll()``.

kazoo's connection thread waits for its socket through ``handler.select``
about five times per request and reply (the loop, a write, the two reads of
a packet: its length, then its body). kazoo's own ``select`` (since 2.7, to
lift ``select()``'s limit of file descriptors below 1024) builds an epoll
selector, registers the sockets, waits once and closes it, on every call:
four system calls and a few Python objects each time. ``poll()`` has no such
limit and is one system call. In a raw-kazoo model of the dispatcher this
was the largest single saving of client CPU (see benchmarks/README.md, "The
dispatch model"). ``select`` is a method of kazoo's handler interface, so
this is a public override, not a private name.

It also knows of packets read ahead (:func:`celery_zk.compat.kazoo.buffer_reads`):
while some wait in a buffer, their socket is reported readable at once, or
kazoo's loop would wait on a socket whose bytes were already taken.

Its results (:class:`Result`) ask the connection, before a blocking
``get``, whether the waiting thread may read the reply itself
(:meth:`celery_zk.compat.kazoo._DirectRequests.wait`).

And it notices a connection that went silent while requests wait, as
ZooKeeper's own client does ("have not heard from server"): kazoo pings only
after a quiet spell and counts every request it sends as a ping, so a busy
client whose server was cut off (a partition on the server's side) wrote
into the void until its session had expired, instead of moving to another
server in time (the nemesis saw a task run twice so). The reader tells the
handler what the server granted and when bytes arrive; :meth:`PollingHandler.select`
sees every write (kazoo waits for its socket to be writable first) and
reports a socket unanswered for :attr:`PollingHandler.silence` seconds
readable, for the reader to drop it.
"""
from __future__ import annotations

import math
import select
import time
from collections.abc import Sequence
from typing import Any

from kazoo.handlers.threading import AsyncResult, SequentialThreadingHandler

__all__ = ["PollingHandler", "Result"]

_READ = select.POLLIN | select.POLLPRI
_WRITE = select.POLLOUT
#: Reported whatever was asked for: the socket is closed or failed, and the
#: next read or write on it says how (kazoo's epoll-based select does the same).
_TROUBLE = select.POLLERR | select.POLLHUP | select.POLLNVAL


#: While packets wait in the read buffer, the other sockets (kazoo's wake-up
#: for requests to send) are looked at every this many packets.
HELD_PEEK = 8


def _fd(fileobj: Any) -> int:
    return fileobj if isinstance(fileobj, int) else int(fileobj.fileno())


class Result(AsyncResult):
    """kazoo's result of a request, whose waiting thread may read the reply
    itself: :attr:`reader` is set when the request was written by that thread
    (:meth:`celery_zk.compat.kazoo._DirectRequests.wait`)."""

    reader: Any = None

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        reader = self.reader
        if reader is not None and block:
            reader(self, timeout)
        return super().get(block, timeout)


class PollingHandler(SequentialThreadingHandler):
    """:class:`~kazoo.handlers.threading.SequentialThreadingHandler` whose
    ``select`` is one ``poll()``, with ``select()``'s signature and results."""

    #: A socket whose next bytes were read ahead and wait in a buffer (or None).
    held: Any = None
    #: Seconds a write may go without a byte from the server before its
    #: connection is taken for dead: two thirds of the session timeout the
    #: server granted, as in ZooKeeper's client (which leaves a third to reach
    #: another server). None: not looked at (no reader told us; TLS).
    silence: float | None = None
    #: (socket, when): the first write on it since the server was last heard.
    asked: tuple[Any, float] | None = None
    #: Looks answered from the buffer in a row (see HELD_PEEK).
    _held_looks = 0

    def async_result(self) -> Result:
        return Result(self)

    def asking(self, sock: Any) -> None:
        """A request is about to be written to ``sock``: its server owes a reply
        from now on (unless an earlier write still waits for one)."""
        asked = self.asked
        if asked is None or asked[0] is not sock:
            self.asked = (sock, time.monotonic())

    def heard(self, sock: Any) -> None:
        """Bytes came from ``sock``'s server: what was asked is being answered."""
        asked = self.asked
        if asked is not None and asked[0] is sock:
            self.asked = None

    def select(self, rlist: Sequence[Any], wlist: Sequence[Any], xlist: Sequence[Any],
               timeout: float | None = None) -> tuple[list[Any], list[Any], list[Any]]:
        if timeout is not None:
            if not isinstance(timeout, (int, float)):
                raise TypeError("timeout must be a number")
            if timeout < 0:
                raise ValueError("timeout must be non-negative")
        if wlist and not rlist:   # kazoo about to write a request or a ping
            self.asking(wlist[0])
        ready = self.held
        if ready is None or not any(f is ready for f in rlist):
            ready = (None if self.asked is None
                     else next((f for f in rlist if self.silent(f)), None))
        if ready is not None:
            # Its packets are here already (or it is silent: its read says
            # which): look at the rest without waiting, but only every few
            # packets while a buffer drains (a busy consumer's burst of watch
            # events): a poll() per packet released the GIL to the consuming
            # thread and took it back, once per event. Every HELD_PEEK-th look
            # still sees a request waiting to be sent (kazoo's PR #633).
            self._held_looks += 1
            if ready is self.held and not wlist and self._held_looks % HELD_PEEK:
                return [ready], [], []
            readable, writable = self._poll([f for f in rlist if f is not ready], wlist, 0)
            return [ready, *readable], writable, []
        self._held_looks = 0
        readable, writable = self._poll(rlist, wlist, timeout)
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

    def silent(self, sock: Any) -> bool:
        """Whether ``sock``'s server has left a write unanswered for
        :attr:`silence` seconds."""
        asked, silence = self.asked, self.silence
        return (asked is not None and asked[0] is sock and silence is not None
                and time.monotonic() - asked[1] > silence)

    def wait_readable(self, sock: Any, timeout: float | None) -> bool:
        """Whether ``sock`` itself has bytes (or trouble) within ``timeout`` s,
        whatever is held: for the reader that fills the buffer."""
        poller = select.poll()
        poller.register(_fd(sock), _READ)
        wait = None if timeout is None else math.ceil(timeout * 1000)
        return bool(poller.poll(wait))
