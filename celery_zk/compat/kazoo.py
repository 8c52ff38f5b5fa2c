"""kazoo's private names, used for the requests kazoo has no method for.

kazoo (2.9 to 2.11) cannot send ZooKeeper 3.6's ``addWatch``,
``removeWatches`` (python-zk/kazoo#715 is unmerged) or ``multiRead``
(:mod:`celery_zk.zk.reads`), nor hand the events of a
persistent watch to anyone: its connection drops an event no one of its own
watchers asked for. :mod:`celery_zk.zk.watches` and :mod:`celery_zk.zk.reads`
therefore need three private names, all here:

* ``KazooClient._call(request, async_result)``: queue a request kazoo has no
  method for (Zuul sends ``addWatch`` the same way);
* ``ConnectionHandler._read_watch_event(buffer, offset)``: wrapped, so the
  events of our watches are read before kazoo looks for its own watchers;
* ``KazooClient._data_watchers`` / ``_child_watchers``: whether kazoo has a
  watcher of its own on the event's path (then it gets the event too);
* ``ConnectionHandler._read(length, timeout)``, ``_socket`` and
  ``_socket_error_handling``: :func:`buffer_reads` replaces the read of one
  connection (an instance attribute) with one that takes whatever the socket
  holds in one ``recv()``. kazoo waits for and reads every packet in two
  steps (its length, then the rest): four system calls a packet, each
  giving up the GIL to the process's other threads and waiting to get it
  back; under load a read now takes many packets. The watch events that
  wait in that buffer right behind one kazoo's loop read are handed out
  with it (up to the first reply, so the server's order holds), not one per
  turn of the loop: a busy consumer gets an event per message given, acked
  and moved. The same reader notes
  every byte that arrives and the session timeout the server granted (the
  first packet, ZooKeeper's ConnectResponse), for the handler's watch on a
  silent server (:mod:`celery_zk.zk.handler`), which sees each write
  through ``handler.select`` (kazoo waits for its socket to be writable
  before it sends). A kazoo that stopped doing so would leave only its own
  ping: ``tests/integration/test_wire.py`` runs on every supported release.

* ``ConnectionHandler._socket`` again: :func:`abort_connect` shuts down the
  socket of a client being stopped while it waits for a server that never
  answers (:meth:`celery_zk.zk.session.SharedSession.give_up`): kazoo's
  connect attempt reads the server's reply for up to ``session_timeout`` s
  and looks at nothing else meanwhile, so its ``stop()`` waited that long.

* ``KazooClient._call``, ``_queue``, ``_pending``, ``_state``, ``_stopped``,
  ``_session_callback``, ``_session_timeout``, ``hosts`` and
  ``ConnectionHandler._xid``, ``_write``, ``_send_request``, ``_send_ping``:
  :func:`direct_requests` writes a request to the socket from the thread that
  makes it, where kazoo queues it for its connection thread and wakes that
  thread through a socket pair (a ``send()`` that gives the GIL to the
  connection thread, which serializes and writes the request while the
  caller waits to get the GIL back). One lock orders the caller's writes,
  kazoo's own (``_send_request``, ``_send_ping``) and the xids; the caller
  puts its request in ``_pending`` before its bytes go, so kazoo's loop,
  which still reads every reply, finds it there. Measured on the benchmark
  machine: a synced request 0.05-0.3 ms sooner (p50) and a prefork parent 3%
  cheaper per task (``benchmarks/README.md``, *Requests written by the
  thread that makes them*). With ``ConnectionHandler._read_socket``
  (wrapped: kazoo's loop reads under a lock) and ``_write_sock`` (to wake
  the loop), the thread that waits for such a request's reply reads the
  socket itself (:meth:`_DirectRequests.wait`) while the next packet is a
  reply, and leaves watch events to kazoo's loop.

Fallback: without the read's names kazoo reads as it always did; without
``_socket`` a stop waits for the connect attempt to time out; without the
names of :func:`direct_requests` every request goes through kazoo's queue. Without the others
:class:`~celery_zk.zk.watches.TreeWatches` reports
persistent watches unsupported, and consumers use one-shot child watches
(one more request per idle delivery) and one ``get`` per body (no
``multiRead``), as with a server older than 3.6.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionDropped
from kazoo.protocol.connection import PING_XID, WATCH_XID, ConnectionHandler
from kazoo.protocol.serialization import (
    Auth,
    Close,
    Watch,
    int_int_struct,
    int_struct,
    reply_header_struct,
)
from kazoo.protocol.states import KeeperState

from . import PrivateAPIChanged, describe

__all__ = ["abort_connect", "buffer_reads", "direct_requests", "intercept_watch_events",
           "missing", "send"]

logger = logging.getLogger(__name__)

_USE = "to send addWatch/removeWatches and read persistent watch events"
_FALLBACK = "Persistent watches are off; consumers use one-shot child watches."

#: Every private name this module touches: where it lives, and the attribute.
PRIVATE: tuple[tuple[type, str], ...] = (
    (KazooClient, "_call"),
    (ConnectionHandler, "_read_watch_event"),
)
#: The same for :func:`buffer_reads` (``_socket`` is set on an instance).
PRIVATE_READS: tuple[tuple[type, str], ...] = (
    (ConnectionHandler, "_read"),
    (ConnectionHandler, "_socket_error_handling"),
)
_READS_USE = "to read whole socket buffers"
_READS_FALLBACK = "kazoo reads each packet in two steps, as it always did."
#: Set in ``KazooClient.__init__``: checked on an instance.
PRIVATE_INSTANCE = ("_connection", "_data_watchers", "_child_watchers")


#: The same for :func:`direct_requests`.
PRIVATE_DIRECT: tuple[tuple[type, str], ...] = (
    (KazooClient, "_call"),
    (KazooClient, "_session_callback"),
    (ConnectionHandler, "_write"),
    (ConnectionHandler, "_send_request"),
    (ConnectionHandler, "_send_ping"),
    (ConnectionHandler, "_read_socket"),
)
#: Set in ``KazooClient.__init__`` / ``ConnectionHandler.__init__``: checked on instances.
PRIVATE_DIRECT_INSTANCE = ("_queue", "_pending", "_state", "_stopped", "_session_timeout",
                           "hosts")
_DIRECT_USE = "to write requests from the thread that makes them"
_DIRECT_FALLBACK = "Every request goes through kazoo's queue and connection thread."


def _direct_missing(client: KazooClient | None = None) -> list[str]:
    """The names of :data:`PRIVATE_DIRECT` the installed kazoo lacks (with
    ``client``, of :data:`PRIVATE_DIRECT_INSTANCE` and ``_xid`` too)."""
    names = [f"{owner.__name__}.{name}" for owner, name in PRIVATE_DIRECT
             if not callable(getattr(owner, name, None))]
    if client is not None:
        names += [f"KazooClient().{name}" for name in PRIVATE_DIRECT_INSTANCE
                  if not hasattr(client, name)]
        connection = getattr(client, "_connection", None)
        names += [f"ConnectionHandler().{name}" for name in ("_xid", "_write_sock")
                  if not hasattr(connection, name)]
    return names


def _changed(name: str) -> PrivateAPIChanged:
    return PrivateAPIChanged(describe("kazoo", name, _USE, _FALLBACK))


def missing(client: KazooClient | None = None) -> list[str]:
    """What the installed kazoo lacks of :data:`PRIVATE` (with ``client``, of
    :data:`PRIVATE_INSTANCE` too), one message each; empty when all is there."""
    problems = [str(_changed(f"{owner.__name__}.{name}"))
                for owner, name in PRIVATE if not callable(getattr(owner, name, None))]
    problems += [describe("kazoo", f"{owner.__name__}.{name}", _READS_USE, _READS_FALLBACK)
                 for owner, name in PRIVATE_READS if not callable(getattr(owner, name, None))]
    problems += [describe("kazoo", name, _DIRECT_USE, _DIRECT_FALLBACK)
                 for name in _direct_missing(client)]
    if client is not None:
        problems += [str(_changed(f"KazooClient().{name}"))
                     for name in PRIVATE_INSTANCE if not hasattr(client, name)]
        if not hasattr(getattr(client, "_connection", None), "_socket"):
            problems.append(describe("kazoo", "ConnectionHandler()._socket", _READS_USE,
                                     _READS_FALLBACK))
    return problems


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
    data_watchers = getattr(client, "_data_watchers", None)
    child_watchers = getattr(client, "_child_watchers", None)
    if data_watchers is None or child_watchers is None:
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
        # The events right behind it in the read buffer, here and now: a busy
        # consumer's burst (an event per message given, acked, moved) costs a
        # turn of kazoo's loop per event otherwise. Only events, and only up to
        # the first reply: the order the server sent them in is kept.
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
        self.pieces = 0   # reads served on this socket (the first two: the ConnectResponse)
        self.reads = self.recvs = 0   # kazoo's reads served, socket reads made

    def __call__(self, length: int, timeout: float) -> bytes:
        connection, handler = self.connection, self.handler
        sock = connection._socket
        if sock is None or hasattr(sock, "pending"):
            # TLS: the SSL layer holds decrypted bytes of its own; kazoo's read knows it.
            handler.silence = None
            return self.original(length, timeout)
        if sock is not self.sock:   # a new connection: nothing buffered belongs to it
            self.sock, self.buf, self.pieces = sock, bytearray(), 0
        buf = self.buf
        try:
            if len(buf) < length:   # the socket's error handling only around socket calls
                self._fill(sock, length, timeout)
            data = bytes(buf[:length])
            del buf[:length]
            self.reads += 1
            self.pieces += 1
            if self.pieces == 2:
                self._granted(data)
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
            self.reads += 2 * len(taken)
            self.handler.held = self.sock if buf else None
        return taken

    def peek(self, sock: Any, deadline: float) -> int | None:
        """The xid of the next packet once all of it is in the buffer, reading
        what ``sock`` sends until ``deadline`` (monotonic); None when it is not
        all here by then, or ``sock`` is not the socket being read."""
        if sock is not self.sock:
            return None
        buf, handler = self.buf, self.handler
        want = 8   # a packet's length, and its reply header's xid
        with self.connection._socket_error_handling():
            while True:
                if len(buf) >= 4:
                    want = max(8, 4 + int_struct.unpack_from(buf, 0)[0])
                if len(buf) >= want:
                    return int(int_struct.unpack_from(buf, 4)[0])
                left = deadline - time.monotonic()
                if left <= 0 or not handler.wait_readable(sock, left):
                    return None
                self._add(sock, sock.recv(max(READ_SIZE, want - len(buf))))
                handler.held = sock

    def _fill(self, sock: Any, length: int, timeout: float) -> None:
        """Read from ``sock`` until the buffer holds ``length`` bytes."""
        connection, handler, buf = self.connection, self.handler, self.buf
        with connection._socket_error_handling():
            while len(buf) < length:
                size = max(READ_SIZE, length - len(buf))
                # dead, unless its bytes came just now
                if handler.silent(sock) and not handler.wait_readable(sock, 0):
                    raise ConnectionDropped(
                        f"no reply from the server for {handler.silence:.1f}s "
                        "while requests waited: taken for dead (a partition?)")
                # kazoo's loop reads once its poll saw bytes: try first, and
                # wait only if there are none (a system call less per read).
                try:
                    chunk = sock.recv(size)
                except BlockingIOError:
                    if not handler.wait_readable(sock, timeout):
                        raise handler.timeout_exception(
                            "socket time-out during read") from None
                    chunk = sock.recv(size)
                self._add(sock, chunk)

    def _add(self, sock: Any, chunk: bytes) -> None:
        """Take one ``recv()``'s bytes into the buffer (none: the server closed)."""
        self.recvs += 1
        if not chunk:
            raise ConnectionDropped("socket connection broken")
        self.handler.heard(sock)
        self.buf += chunk

    def _granted(self, connect_response: bytes) -> None:
        """The first packet of a connection is ZooKeeper's ConnectResponse
        (protocolVersion, timeOut in ms, ...): the session timeout granted,
        which sets how long a request may go unanswered (see
        :class:`~celery_zk.zk.handler.PollingHandler`). A timeout of 0 is the
        answer for an expired session: nothing to go by."""
        if len(connect_response) >= 8:
            granted = struct.unpack_from("!i", connect_response, 4)[0]
            if granted > 0:
                self.handler.silence = granted * 2 / 3 / 1000


def buffer_reads(client: KazooClient) -> bool:
    """Let ``client``'s connection read whole socket buffers (see the module
    docstring); its handler must be a :class:`~celery_zk.zk.handler.PollingHandler`,
    which reports the socket readable while packets wait in the buffer.
    False (kazoo's own reads, logged once) when kazoo's internals differ."""
    connection: Any = getattr(client, "_connection", None)
    original = getattr(connection, "_read", None)
    if (original is None or not hasattr(connection, "_socket")
            or not callable(getattr(connection, "_socket_error_handling", None))):
        _log_fallback("ConnectionHandler._read/_socket/_socket_error_handling")
        return False
    if not hasattr(client.handler, "wait_readable"):
        return False   # not our handler: it would wait on a socket whose bytes we took
    connection._read = _BufferedReads(connection, original, client.handler)
    return True


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


#: Most seconds a caller reads the socket while it waits for its reply (then
#: kazoo's loop reads, as for any other): a ping is not held up for longer.
LEAD = 0.2

#: Requests kazoo's loop must send itself: an auth (its own xid, answered on
#: the loop's terms) and the close (a stop() orders it behind what is queued).
_LOOP_ONLY = frozenset({Auth.type, Close.type})


class _DirectRequests:
    """One client's requests, written to its socket by the thread that makes
    them while the connection is up and nothing waits in kazoo's queue.

    kazoo's loop still reads every reply (from ``_pending``, in order) and
    handles every drop. The *gate* says whether a request may go direct: it
    opens when kazoo's loop itself sends (a request or a ping) on a
    connected, unstopped client (its handshake and auth, which read replies
    in line, are over then), and closes under the same lock before kazoo
    hears of any state change other than CONNECTED. So a request put in
    ``_pending`` is either written before kazoo's drop handling fails all of
    ``_pending`` (ConnectionLoss, as for a queued request), or it goes to the
    queue: none is left behind with a stale xid for the next connection.
    """

    def __init__(self, client: KazooClient, connection: Any) -> None:
        self.client, self.connection = client, connection
        self.lock = threading.RLock()
        self.open = False
        self.direct = 0   # requests written directly (for tests and diagnostics)
        self.timeout = client._session_timeout / 1000.0 / max(1, len(client.hosts))
        # Our handler hears of each write (its silent-server watch); another
        # handler gets kazoo's write, which polls first and tells its select.
        self._asking: Callable[[Any], None] | None = getattr(client.handler, "asking", None)
        self._queued_call = client._call
        self._session_callback = client._session_callback
        # Replies read by the thread that waits for one (see _lead): only with
        # our buffered reads, whose buffer says what the next packet is.
        reads = connection._read
        self.reads: _BufferedReads | None = reads if isinstance(reads, _BufferedReads) else None
        self.reading = threading.Lock()   # held by whoever reads the socket
        self._read_socket: Callable[[float], Any] = connection._read_socket
        self._loop_waits = False   # kazoo's loop waits for the reading lock
        self.led = 0   # replies read by a waiting caller (for tests and diagnostics)

    def install(self) -> None:
        connection = self.connection
        self.client._call = self.call
        self.client._session_callback = self.session_callback
        connection._send_request = partial(self._loop_sends, connection._send_request)
        connection._send_ping = partial(self._loop_sends, connection._send_ping)
        if self.reads is not None:
            connection._read_socket = self._loop_reads

    def call(self, request: Any, async_object: Any) -> Any:
        kind = getattr(request, "type", None)
        client = self.client
        if not self.open or kind is None or kind in _LOOP_ONLY or client._queue:
            return self._queued_call(request, async_object)
        body = request.serialize()   # before anything changes: it may raise (bad input)
        with self.lock:
            # Again under the lock: kazoo's loop sends what it queued (and pops
            # it) under this lock, so an empty queue means everything this
            # thread queued before is written: the order holds.
            if self.open and not client._queue:
                self._write(request, async_object, kind, body)
                return True
        # Queued outside the lock: kazoo wakes its loop through a socket pair
        # that fills up, and its loop drains it only once it has the lock.
        return self._queued_call(request, async_object)

    def _write(self, request: Any, async_object: Any, kind: int, body: bytes) -> None:
        """Write one request (under :attr:`lock`), listed in ``_pending`` first."""
        client, connection = self.client, self.connection
        xid = connection._xid = (connection._xid % 2147483647) + 1
        client._pending.append((request, async_object, xid))
        self.direct += 1
        if self.reads is not None:   # its caller may read the reply itself
            async_object.reader = self.wait   # our handler's Result asks it first
        message = int_struct.pack(len(body) + 8) + int_int_struct.pack(xid, kind) + body
        try:
            # Sent at once when the socket takes it (it nearly always has the
            # room): kazoo's write polls first, a system call more. The handler
            # still hears of the write, for its silent-server watch.
            sock, asking = connection._socket, self._asking
            sent = 0
            if asking is not None:
                asking(sock)
                try:
                    sent = sock.send(message)
                except BlockingIOError:
                    sent = 0
            if sent < len(message):
                connection._write(message[sent:], self.timeout)
        except Exception:   # noqa: BLE001 - a half-written request garbles the stream
            # End the connection: kazoo's loop sees it, reconnects and fails
            # what is pending, this request included (ConnectionLoss).
            self.open = False
            abort_connect(client)

    def _loop_sends(self, send: Callable[..., Any], *args: Any) -> Any:
        """kazoo's loop sending (a queued request, a ping): under the lock, and
        the gate opens after it on a connected, unstopped client."""
        client = self.client
        with self.lock:
            result = send(*args)
            self.open = (client._state == KeeperState.CONNECTED
                         and not client._stopped.is_set())
        return result

    # -- replies read by the thread that waits for one ----------------------------
    def wait(self, async_object: Any, timeout: float | None) -> None:
        """Before a blocking ``get`` of a request written directly: its caller
        reads the socket while it waits, if no one else does (see :meth:`_lead`)."""
        if not async_object.ready() and self.reading.acquire(blocking=False):
            try:
                self._lead(async_object, LEAD if timeout is None else min(timeout, LEAD))
            finally:
                self.reading.release()
                self._hand_back()

    def _lead(self, async_object: Any, most: float) -> None:
        """Read replies until ``async_object``'s has come, for up to ``most`` s.

        kazoo's loop reads a reply and then wakes the thread waiting for it: two
        thread wake-ups per request, each a wait for a core on a busy machine.
        The waiting thread reads instead, through kazoo's own ``_read_socket``,
        as long as the next packet is a reply or a ping. It leaves the rest to
        kazoo's loop: a watch event (whose handlers run on kazoo's thread,
        holding none of a caller's locks), the reply to a close or an auth,
        trouble on the socket (shut down, for the loop to reconnect), and a
        reply slower than ``most``.
        """
        reads, connection, client = self.reads, self.connection, self.client
        assert reads is not None
        deadline = time.monotonic() + most
        while not async_object.ready():
            sock = connection._socket
            if not self.open or sock is None:
                return
            try:
                xid = reads.peek(sock, deadline)
                if xid is None or (xid < 0 and xid != PING_XID):
                    return   # not here in time, a watch event, an auth's reply
                with self.lock:   # kazoo's loop lists what it sends under it
                    pending = client._pending
                    if not self.open or (xid != PING_XID and (
                            not pending
                            or getattr(pending[0][0], "type", None) in _LOOP_ONLY)):
                        return
                    self._read_socket(self.timeout)   # all in the buffer: no wait
                    self.led += 1
            except Exception:   # noqa: BLE001 - the loop's to handle: it sees the socket shut
                if connection._socket is sock:   # not a newer connection's
                    self.open = False
                    abort_connect(client)
                return

    def _hand_back(self) -> None:
        """After a caller's reads: packets it left in the buffer are the loop's,
        which may be waiting on a socket that has nothing more to say."""
        reads = self.reads
        if reads is None or not reads.buf or self._loop_waits:
            return   # nothing left, or the loop reads it once it has the lock
        try:
            self.connection._write_sock.send(b"\0")   # kazoo's own wake-up
        except (AttributeError, OSError):
            pass   # closed meanwhile: nothing to hand back

    def _loop_reads(self, read_timeout: float) -> Any:
        """kazoo's loop reading a packet: only once no caller reads, and only if
        one is there still (a caller may have read what woke the loop)."""
        self._loop_waits = True
        with self.reading:
            self._loop_waits = False
            reads, handler = self.reads, self.client.handler
            sock = self.connection._socket
            if (reads is not None and sock is reads.sock and not reads.buf
                    and not handler.silent(sock) and not handler.wait_readable(sock, 0)):
                return None
            return self._read_socket(read_timeout)

    def session_callback(self, state: Any) -> Any:
        if state != KeeperState.CONNECTED:
            with self.lock:   # waits for a direct write under way, then shuts the gate
                self.open = False
        return self._session_callback(state)


def direct_requests(client: KazooClient) -> bool:
    """Let ``client``'s requests be written by the threads that make them (see
    :class:`_DirectRequests` and the module docstring). False (kazoo's queue
    for all, logged once) when kazoo's internals differ; False for TLS, whose
    socket is not to be written by one thread while another reads it."""
    absent = _direct_missing(client)
    if absent:
        _log_fallback("/".join(absent), _DIRECT_USE, _DIRECT_FALLBACK)
        return False
    if client.use_ssl:
        return False
    _DirectRequests(client, client._connection).install()
    return True


_logged: set[str] = set()


def _log_fallback(name: str, use: str = _READS_USE, fallback: str = _READS_FALLBACK) -> None:
    if name not in _logged:
        _logged.add(name)
        logger.warning("%s", describe("kazoo", name, use, fallback))
