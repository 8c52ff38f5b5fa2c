"""kazoo's private names: the requests kazoo has no method for, and reads of
whole socket buffers.

kazoo (2.9 to 2.11) cannot send ZooKeeper 3.6's ``addWatch``,
``removeWatches`` (python-zk/kazoo#715 is unmerged) or ``multiRead``, nor
hand the events of a persistent watch to anyone: its connection drops an
event none of its own watchers asked for. :mod:`celery_zk.zk.watches` and
:mod:`celery_zk.zk.reads` (and :mod:`celery_zk.zk.multi`, which sends kazoo's own
``Transaction`` serialized in one pass) therefore need these private names,
all here:

* ``KazooClient._call(request, async_result)``: queue a request kazoo has no
  method for on kazoo's own request queue (Zuul sends ``addWatch`` the same
  way); kazoo's connection thread writes it and reads its reply;
* ``ConnectionHandler._read_watch_event(buffer, offset)``: wrapped, so the
  events of our watches are read before kazoo looks for its own watchers;
* ``KazooClient._data_watchers`` / ``_child_watchers``: whether kazoo has a
  watcher of its own on the event's path (then it gets the event too);
* ``ConnectionHandler._read(length, timeout)``, ``_socket`` and
  ``_socket_error_handling``: :func:`buffer_reads` replaces the read of one
  connection (an instance attribute) with one that takes whatever the
  socket holds in one ``recv()``. kazoo waits for and reads every packet in
  two steps (its length, then the rest): four system calls a packet, each
  giving up the GIL to the process's other threads and waiting to get it
  back; under load one read now takes many packets. The watch events that
  wait in that buffer right behind one kazoo's loop read are handed out
  with it (up to the first reply, so the server's order holds), not one per
  turn of the loop: a busy consumer gets an event per message given, acked
  and moved. kazoo's loop still reads every packet, and writes every
  request; measured in ``docs/performance.md`` (the ledger).
* ``ConnectionHandler._socket``: :func:`abort_connect` shuts down the socket
  of a client being stopped while it waits for a server that never answers
  (:func:`celery_zk.zk.background.give_up`): kazoo's connect
  attempt reads the server's reply for up to ``session_timeout`` s and looks
  at nothing else meanwhile, so its ``stop()`` waited that long.

* ``kazoo.exceptions.QuotaExceededError`` is public from kazoo 2.10; on
  2.9 the server's QUOTAEXCEEDED (-125) has no class, so one is registered
  in kazoo's public ``EXCEPTIONS`` table (the storage budget's last line,
  :mod:`celery_zk.broker.budget`).

Without the first four there is no persistent watch, and celery_zk's
consumers and dispatchers have nothing to wait on: :func:`require` refuses
to start, naming what is missing. Without the reads' names kazoo reads as it
always did (logged once); without ``_socket`` a stop waits for the connect
attempt to time out. ``docs/kazoo-patch.md`` is the change to kazoo
that would let this module go.
"""
from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import EXCEPTIONS, ConnectionDropped, ZookeeperError
from kazoo.protocol.connection import WATCH_XID, ConnectionHandler
from kazoo.protocol.serialization import Watch, int_struct, reply_header_struct

from . import PrivateAPIChanged, describe

__all__ = ["QuotaExceededError", "abort_connect", "buffer_reads", "intercept_watch_events",
           "missing", "require", "send"]

logger = logging.getLogger(__name__)

try:
    from kazoo.exceptions import QuotaExceededError
except ImportError:   # kazoo 2.9
    class QuotaExceededError(ZookeeperError):  # type: ignore[no-redef]
        """ZooKeeper's QUOTAEXCEEDED: a write past an enforced quota."""

        code = -125

    EXCEPTIONS[QuotaExceededError.code] = QuotaExceededError

_USE = "to send addWatch, removeWatches and multiRead and read persistent watch events"
_CONSEQUENCE = "celery_zk cannot wait for messages without them."

#: Every private name this module needs: where it lives, and the attribute.
PRIVATE: tuple[tuple[type, str], ...] = (
    (KazooClient, "_call"),
    (ConnectionHandler, "_read_watch_event"),
)
#: Set in ``KazooClient.__init__``: checked on an instance.
PRIVATE_INSTANCE = ("_connection", "_data_watchers", "_child_watchers")
#: The same for :func:`buffer_reads` (``_socket`` is set on an instance).
PRIVATE_READS: tuple[tuple[type, str], ...] = (
    (ConnectionHandler, "_read"),
    (ConnectionHandler, "_socket_error_handling"),
)
_READS_USE = "to read whole socket buffers"
_READS_FALLBACK = "kazoo reads each packet in two steps, as it always did."


def _changed(name: str) -> PrivateAPIChanged:
    return PrivateAPIChanged(describe("kazoo", name, _USE, _CONSEQUENCE))


def missing(client: KazooClient | None = None) -> list[str]:
    """What the installed kazoo lacks of :data:`PRIVATE` (with ``client``, of
    :data:`PRIVATE_INSTANCE` too), one message each; empty when all is there."""
    problems = [str(_changed(f"{owner.__name__}.{name}"))
                for owner, name in PRIVATE if not callable(getattr(owner, name, None))]
    problems += [describe("kazoo", f"{owner.__name__}.{name}", _READS_USE, _READS_FALLBACK)
                 for owner, name in PRIVATE_READS if not callable(getattr(owner, name, None))]
    if client is not None:
        problems += [str(_changed(f"KazooClient().{name}"))
                     for name in PRIVATE_INSTANCE if not hasattr(client, name)]
        if not hasattr(getattr(client, "_connection", None), "_socket"):
            problems.append(describe("kazoo", "ConnectionHandler()._socket",
                                     "to stop a client whose connect attempt waits, and "
                                     + _READS_USE,
                                     "A stop waits for the attempt to time out; "
                                     + _READS_FALLBACK))
    return problems


def require() -> None:
    """Raise :class:`PrivateAPIChanged` naming what this kazoo lacks of what
    every consumer needs (checked once a transport is made)."""
    problems = [str(_changed(f"{owner.__name__}.{name}"))
                for owner, name in PRIVATE if not callable(getattr(owner, name, None))]
    if problems:
        raise PrivateAPIChanged("\n".join(problems))


def send(client: KazooClient, request: Any) -> Any:
    """Queue ``request`` (a kazoo-style request object) on ``client``'s
    connection; its async result. Raises :class:`PrivateAPIChanged` when kazoo
    cannot."""
    call = getattr(client, "_call", None)
    if call is None:
        raise _changed("KazooClient._call")
    result = client.handler.async_result()
    call(request, result)
    return result


def intercept_watch_events(client: KazooClient,
                           ours: Callable[[int, str], bool]) -> None:
    """Show every watch event of ``client`` to ``ours(type, path)`` first (on
    kazoo's connection thread; ``path`` without the chroot). An event ``ours``
    returns True for goes to kazoo's own watchers only if one of them watches
    that path too. Raises :class:`PrivateAPIChanged` when kazoo's internals differ.
    """
    connection = getattr(client, "_connection", None)
    original = getattr(connection, "_read_watch_event", None)
    if original is None:
        raise _changed("ConnectionHandler._read_watch_event")
    if getattr(client, "_data_watchers", None) is None or getattr(
            client, "_child_watchers", None) is None:
        raise _changed("KazooClient._data_watchers/_child_watchers")

    def read_one(buffer: bytes, offset: int) -> None:
        watch, _ = Watch.deserialize(buffer, offset)
        taken = ours(watch.type, client.unchroot(watch.path))
        # kazoo replaces these dicts on a session change: read them each time.
        if (not taken or watch.path in client._data_watchers
                or watch.path in client._child_watchers):
            original(buffer, offset)   # kazoo's own watchers

    def read_watch_event(buffer: bytes, offset: int) -> None:
        read_one(buffer, offset)
        # The events right behind it in the read buffer, here and now: only
        # events, and only up to the first reply (the server's order is kept).
        reads = connection._read   # type: ignore[union-attr]
        if isinstance(reads, _BufferedReads):
            for packet in reads.watch_events(EVENT_BATCH):
                read_one(packet, reply_header_struct.size)

    connection._read_watch_event = read_watch_event  # type: ignore[union-attr]


#: Most watch events read from the buffer behind the one kazoo's loop read,
#: before its loop gets a turn (it also sends requests).
EVENT_BATCH = 64
#: Most bytes one read takes from the socket: a few hundred packets of a busy
#: consumer, or the rest of one big reply.
READ_SIZE = 65536


class _BufferedReads:
    """One connection's reads: whole socket buffers, packets handed out from them."""

    def __init__(self, connection: Any, original: Callable[[int, float], bytes],
                 handler: Any) -> None:
        self.connection = connection
        self.original = original
        self.handler = handler
        self.sock: Any = None
        self.buf = bytearray()
        self.recvs = 0   # recv() calls that brought bytes (the tests count them)

    def __call__(self, length: int, timeout: float) -> bytes:
        connection, handler = self.connection, self.handler
        sock = connection._socket
        if sock is None or hasattr(sock, "pending"):
            # TLS: the SSL layer holds decrypted bytes of its own; kazoo's read knows it.
            return self.original(length, timeout)
        if sock is not self.sock:   # a new connection: nothing buffered belongs to it
            self.sock, self.buf = sock, bytearray()
        buf = self.buf
        try:
            if len(buf) < length:   # the socket's error handling only around socket calls
                self._fill(sock, length, timeout)
            data = bytes(buf[:length])
            del buf[:length]
        finally:
            # What is left is the start of the next packets: kazoo's loop must
            # not wait on the socket for them.
            handler.held = sock if buf else None
        return data

    def watch_events(self, most: int) -> list[bytes]:
        """Up to ``most`` whole watch-event packets (each from its reply header
        on) from the head of the buffer, taken out of it; none once the next
        packet is a reply or not all here."""
        buf = self.buf
        taken: list[bytes] = []
        while len(taken) < most and len(buf) >= 8:
            # kazoo's own wire constants: a packet's length, then its reply
            # header (xid, zxid, err), whose xid says a watch event.
            length = int_struct.unpack_from(buf, 0)[0]
            if len(buf) < 4 + length or int_struct.unpack_from(buf, 4)[0] != WATCH_XID:
                break
            taken.append(bytes(buf[4:4 + length]))
            del buf[:4 + length]
        if taken:
            self.handler.held = self.sock if buf else None
        return taken

    def _fill(self, sock: Any, length: int, timeout: float) -> None:
        """Read from ``sock`` until the buffer holds ``length`` bytes."""
        handler, buf = self.handler, self.buf
        with self.connection._socket_error_handling():
            while len(buf) < length:
                # kazoo's loop reads once its poll saw bytes: try first, and
                # wait only if there are none (a system call less per read).
                try:
                    chunk = sock.recv(max(READ_SIZE, length - len(buf)))
                except BlockingIOError:
                    if not handler.wait_readable(sock, timeout):
                        raise handler.timeout_exception(
                            "socket time-out during read") from None
                    continue
                if not chunk:
                    raise ConnectionDropped("socket connection broken")
                handler.heard(sock)
                self.recvs += 1
                buf += chunk


def buffer_reads(client: KazooClient) -> bool:
    """Let ``client``'s connection read whole socket buffers (see the module
    docstring); its handler must be a :class:`~celery_zk.zk.handler.PollingHandler`,
    which reports the socket readable while packets wait in the buffer.
    False (kazoo's own reads, logged once) when kazoo's internals differ."""
    connection: Any = getattr(client, "_connection", None)
    original = getattr(connection, "_read", None)
    if (original is None or not hasattr(connection, "_socket")
            or not callable(getattr(connection, "_socket_error_handling", None))):
        if not _told:
            _told.append(True)
            logger.warning("%s", describe("kazoo", "ConnectionHandler._read/_socket/"
                                          "_socket_error_handling", _READS_USE, _READS_FALLBACK))
        return False
    if not hasattr(client.handler, "wait_readable"):
        return False   # not our handler: it would wait on a socket whose bytes we took
    connection._read = _BufferedReads(connection, original, client.handler)
    return True


_told: list[bool] = []   # the fallback of buffer_reads was logged


def abort_connect(client: KazooClient) -> bool:
    """Shut down the socket of ``client``'s connection, so that a read waiting
    on it (a connect attempt to a server that never answers) ends now; False
    when there is none (or kazoo's internals differ: the read then ends at
    its timeout). Only for a client being stopped: kazoo would reconnect."""
    sock = getattr(getattr(client, "_connection", None), "_socket", None)
    if sock is None:
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False   # closed meanwhile, or never connected
    return True
