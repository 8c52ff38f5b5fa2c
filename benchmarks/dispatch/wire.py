"""The kazoo plumbing of the dispatch model that kazoo's public API lacks.

Every private name of kazoo the model touches is here, as
``celery_zk/compat/kazoo.py`` fences them for the transport:

* ``KazooClient._call(request, result)``: send a request kazoo has no method
  for (ZooKeeper 3.6's ``multiRead``, ``addWatch``), or a known request with
  a result object of our own (:class:`Inline`);
* ``ConnectionHandler._read_watch_event``: the events of persistent watches
  (through :func:`celery_zk.compat.kazoo.intercept_watch_events`);
* ``ConnectionHandler._read``, ``_socket`` and ``_socket_error_handling``:
  :class:`BufferedReads` reads whatever the socket holds at once.

What each piece saves is measured by ``benchmarks/dispatch_model.py --parts ladder``.
"""
from __future__ import annotations

import logging
import select
from collections import namedtuple
from collections.abc import Callable, Sequence
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import EXCEPTIONS, ConnectionDropped, RolledBackError
from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.protocol.serialization import (
    CheckVersion,
    Create,
    Delete,
    GetChildren,
    GetData,
    Transaction,
    int_struct,
    multiheader_struct,
    read_buffer,
    stat_struct,
    write_string,
)
from kazoo.security import OPEN_ACL_UNSAFE

from celery_zk.compat import kazoo as kazoo_compat
from celery_zk.zk.watches import NODE_CREATED, NODE_DELETED, AddWatch

__all__ = ["NODE_CREATED", "NODE_DELETED", "BufferedReads", "Inline", "MultiRead",
           "SelectHandler",
           "TreeRouter", "call", "check", "create", "delete", "get", "get_children",
           "multi", "multi_failure"]

logger = logging.getLogger(__name__)

PERSISTENT_RECURSIVE = 1   # ZooKeeper's AddWatchMode
_GET_DATA = 4              # OpCode.getData
_VERSION_OFFSET = 4 * 8   # Stat: czxid mzxid ctime mtime (longs), then version (int)


class SelectHandler(SequentialThreadingHandler):
    """kazoo's threading handler with a plain ``select()``.

    kazoo's own builds an epoll selector, registers the sockets, polls once
    and closes it on every call, and its connection thread calls it about
    five times per request and reply (the loop, a write, two reads). Our
    file descriptors are few and small, so ``select()`` does the same job.
    """

    buffered: BufferedReads | None = None

    def select(self, rlist: Sequence[Any], wlist: Sequence[Any], xlist: Sequence[Any],
               timeout: float | None = None) -> tuple[list[Any], list[Any], list[Any]]:
        buffered = self.buffered
        if buffered is not None and buffered.buf and buffered.sock in rlist:
            # Packets already read wait in the buffer: report the socket ready
            # now, with whatever else is (requests to send must not starve).
            ready, out, exc = select.select(rlist, wlist, xlist, 0)
            return [buffered.sock, *[s for s in ready if s is not buffered.sock]], out, exc
        return select.select(rlist, wlist, xlist, timeout)


class BufferedReads:
    """kazoo reads each packet with two select()+recv() pairs (its length, then
    the rest); this reads whatever the socket holds in one recv() and hands
    out packets from it. Needs a :class:`SelectHandler` (which reports a
    socket ready while its buffer holds data)."""

    def __init__(self, client: KazooClient) -> None:
        if not isinstance(client.handler, SelectHandler):
            raise TypeError("BufferedReads needs a SelectHandler")
        self.conn = client._connection
        self.sock: Any = None
        self.buf = bytearray()
        self.conn._read = self._read          # shadows the method on this instance
        client.handler.buffered = self

    def _read(self, length: int, timeout: float) -> bytes:
        conn = self.conn
        sock = conn._socket
        if sock is not self.sock:   # a new connection: nothing buffered belongs to it
            self.sock, self.buf = sock, bytearray()
        buf = self.buf
        with conn._socket_error_handling():
            while len(buf) < length:
                if not select.select([sock], [], [], timeout)[0]:
                    raise conn.handler.timeout_exception("socket time-out during read")
                chunk = sock.recv(max(65536, length - len(buf)))
                if not chunk:
                    raise ConnectionDropped("socket connection broken")
                buf += chunk
        data = bytes(buf[:length])
        del buf[:length]
        return data


class MultiRead(namedtuple("MultiRead", "paths")):
    """ZooKeeper 3.6's ``multiRead`` (opcode 22): many getData in one request.

    The reply holds ``(data, version)`` per path, or the path's exception
    (NoNodeError): unlike a write multi, one missing node fails only itself.
    """

    type = 22

    def serialize(self) -> bytearray:
        head = multiheader_struct.pack(_GET_DATA, False, -1)
        b = bytearray()
        for path in self.paths:
            b += head
            b += write_string(path)
            b.append(0)   # no watch
        b += multiheader_struct.pack(-1, True, -1)
        return b

    @classmethod
    def deserialize(cls, buf: bytes, offset: int) -> list[tuple[bytes, int] | Exception]:
        results: list[tuple[bytes, int] | Exception] = []
        size = multiheader_struct.size
        while True:
            kind, done, _err = multiheader_struct.unpack_from(buf, offset)
            offset += size
            if done:
                return results
            if kind == _GET_DATA:
                data, offset = read_buffer(buf, offset)
                version = int_struct.unpack_from(buf, offset + _VERSION_OFFSET)[0]
                offset += stat_struct.size
                results.append((data, version))
            else:   # an ErrorResponse: its code
                code = int_struct.unpack_from(buf, offset)[0]
                offset += int_struct.size
                results.append(EXCEPTIONS[code]())


class Inline:
    """A reply handler that kazoo's connection thread calls as the reply is read.

    kazoo's own AsyncResult wakes a waiting thread through a Condition, or
    queues its callbacks for the completion thread: one thread hand-off per
    request either way. This one runs ``on_value``/``on_error`` right there,
    so it must never block and never raise (it would stop kazoo's loop).
    """

    __slots__ = ("on_value", "on_error")

    def __init__(self, on_value: Callable[[Any], None],
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.on_value = on_value
        self.on_error = on_error

    def set(self, value: Any = None) -> None:
        try:
            self.on_value(value)
        except Exception:   # kazoo's loop must go on
            logger.exception("dispatch model: reply callback failed")

    def set_exception(self, exc: BaseException) -> None:
        try:
            if self.on_error is None:
                raise exc
            self.on_error(exc)
        except Exception:
            logger.exception("dispatch model: request failed")

    # kazoo treats the object as an AsyncResult in a few places
    def rawlink(self, _callback: Any) -> None:   # pragma: no cover
        raise TypeError("Inline results take no callbacks")


def call(client: KazooClient, request: Any, result: Any = None) -> Any:
    """Send ``request`` through kazoo's queue; ``result``: an :class:`Inline` or
    None for kazoo's AsyncResult (returned)."""
    if result is None:
        result = client.handler.async_result()
    client._call(request, result)
    return result


# Requests built directly: kazoo's TransactionRequest validates and re-wraps each op.
def delete(path: str) -> Delete:
    return Delete(path, -1)


def create(path: str, data: bytes = b"") -> Create:
    return Create(path, data, OPEN_ACL_UNSAFE, 0)


def check(path: str) -> CheckVersion:
    """Exists, whatever its version (-1 matches any)."""
    return CheckVersion(path, -1)


def multi(ops: list[Any]) -> Transaction:
    return Transaction(ops)


def get(path: str) -> GetData:
    return GetData(path, None)


def get_children(path: str) -> GetChildren:
    return GetChildren(path, None)


def multi_failure(results: Any) -> tuple[int, BaseException] | None:
    """The first operation a failed multi names, or None when it committed."""
    if isinstance(results, BaseException):
        return 0, results
    for index, result in enumerate(results):
        if isinstance(result, BaseException) and not isinstance(result, RolledBackError):
            return index, result
    return None


class TreeRouter:
    """The persistent recursive watches of one client.

    ZooKeeper sends a session one event per change, however many of its
    watches cover it, so each event goes to every callback registered on the
    event's path or an ancestor: ``callback(type, path below the watched one)``.
    Callbacks run on kazoo's connection thread.
    """

    def __init__(self, client: KazooClient) -> None:
        self.client = client
        self.callbacks: dict[str, Callable[[int, str], None]] = {}
        kazoo_compat.intercept_watch_events(client, self._dispatch)

    def _dispatch(self, kind: int, path: str) -> bool:
        callbacks = self.callbacks
        taken = False
        head = path
        while head:
            callback = callbacks.get(head)
            if callback is not None:
                taken = True
                try:
                    callback(kind, path[len(head) + 1:])
                except Exception:   # kazoo's loop must go on
                    logger.exception("dispatch model: watch callback for %s failed", path)
            head = head.rpartition("/")[0]
        return taken

    def watch(self, path: str, callback: Callable[[int, str], None]) -> None:
        """Add the watch (before the listing it must cover)."""
        self.callbacks = {**self.callbacks, path: callback}
        kazoo_compat.send(self.client, AddWatch(path, PERSISTENT_RECURSIVE)).get()
