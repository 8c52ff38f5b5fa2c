"""Many node reads in one request: ZooKeeper 3.6's ``multiRead`` (opcode 22),
sent through :func:`celery_zk.compat.kazoo.send`, as ``addWatch`` is (kazoo
has no method for it).

Unlike a ``multi`` it is not atomic: a missing node fails only its own read.
Only for a server known to be 3.6 or newer: the caller asks once it holds a
persistent watch (``addWatch`` came in the same release), since a server
before 3.6 answers an unknown request by closing the connection. See
``docs/design.md``, "One dispatcher per queue".
"""
from __future__ import annotations

from collections import namedtuple
from typing import Any, Union

from kazoo.client import KazooClient
from kazoo.exceptions import EXCEPTIONS, KazooException
from kazoo.protocol.serialization import (
    GetData,
    MultiHeader,
    int_struct,
    multiheader_struct,
    read_buffer,
    stat_struct,
)
from kazoo.protocol.states import ZnodeStat

from ..compat import kazoo as kazoo_compat

__all__ = ["MAX_READS", "MultiRead", "read_many"]

#: Reads per request: enough to take a busy inbox's arrivals at once, few
#: enough that one reply (bodies up to ``chunk_size`` each) stays a few MiB.
MAX_READS = 32

#: One read's outcome: the data and stat, or the error of that read alone.
Outcome = Union[tuple[bytes, ZnodeStat], KazooException]


class MultiRead(namedtuple("MultiRead", "paths")):
    """The request: a ``getData`` (no watch) per path, full paths (chroot included)."""

    type = 22

    def serialize(self) -> bytearray:
        out = bytearray()
        for path in self.paths:
            out += multiheader_struct.pack(GetData.type, False, -1)
            out += GetData(path, None).serialize()
        out += multiheader_struct.pack(-1, True, -1)
        return out

    @classmethod
    def deserialize(cls, buffer: bytes, offset: int) -> list[Outcome]:
        outcomes: list[Outcome] = []
        header, offset = MultiHeader.deserialize(buffer, offset)
        while not header.done:
            if header.type == GetData.type:
                data, offset = read_buffer(buffer, offset)
                stat = ZnodeStat._make(stat_struct.unpack_from(buffer, offset))
                offset += stat_struct.size
                outcomes.append((data or b"", stat))
            elif header.type == -1:   # this read's error: an ErrorResponse (its code)
                code = int_struct.unpack_from(buffer, offset)[0]
                offset += int_struct.size
                outcomes.append(EXCEPTIONS[code]())
            else:
                raise ValueError(f"multiRead: unexpected result type {header.type}")
            header, offset = MultiHeader.deserialize(buffer, offset)
        return outcomes


class _Slot:
    """One path's share of a sent :class:`MultiRead`: kazoo's async result API
    (``ready``, ``get``), so a caller handles it like a ``get_async``."""

    __slots__ = ("_batch", "_index")

    def __init__(self, batch: Any, index: int) -> None:
        self._batch, self._index = batch, index

    def ready(self) -> bool:
        return bool(self._batch.ready())

    def get(self, block: bool = True, timeout: float | None = None) -> tuple[bytes, ZnodeStat]:
        outcome = self._batch.get(block, timeout)[self._index]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def read_many(client: KazooClient, paths: list[str]) -> list[Any]:
    """Start reading ``paths`` (chroot-relative) in requests of up to
    :data:`MAX_READS`; one async result per path, in order. Raises
    :class:`~celery_zk.compat.PrivateAPIChanged` when kazoo cannot send it."""
    root = client.chroot
    slots: list[Any] = []
    for start in range(0, len(paths), MAX_READS):
        batch = kazoo_compat.send(
            client, MultiRead([root + path for path in paths[start:start + MAX_READS]]))
        slots.extend(_Slot(batch, index)
                     for index in range(min(MAX_READS, len(paths) - start)))
    return slots
