"""A ZooKeeper ``multi`` built and serialized with less Python per operation:
the two every delivered message goes through (the dispatcher's gifts, the
batched acks), written in one pass without kazoo's per-argument checks and
path normalizing.

Paths go in as given: build them with :mod:`celery_zk.zk.layout`. The request
is kazoo's own ``Transaction`` (a subclass), queued with
:func:`celery_zk.compat.kazoo.send`, so its reply reads as
``client.transaction()``'s: paths unchrooted, a refused operation an error in
the results, never raised. See ``docs/performance.md``, "The connection:
kazoo and its thread".
"""
from __future__ import annotations

from typing import Any

from kazoo.client import KazooClient
from kazoo.protocol.serialization import (
    CheckVersion,
    Create,
    Delete,
    SetData,
    Transaction,
    int_struct,
    multiheader_struct,
)
from kazoo.security import OPEN_ACL_UNSAFE

from ..compat import kazoo as kazoo_compat

__all__ = ["Multi"]

#: The done MultiHeader (type, done, err) after the last operation; each
#: operation has one of its own before it.
_END = multiheader_struct.pack(-1, True, -1)
_acls: dict[tuple[Any, ...], bytes] = {}


def _acl_bytes(acl: Any) -> bytes:
    """An ACL list as the request carries it (a few distinct ones per process)."""
    key = tuple(acl)
    found = _acls.get(key)
    if found is None:
        parts = [int_struct.pack(len(key))]
        for entry in key:
            scheme, ident = entry.id.scheme.encode(), entry.id.id.encode()
            parts += [int_struct.pack(entry.perms), int_struct.pack(len(scheme)), scheme,
                      int_struct.pack(len(ident)), ident]
        found = _acls[key] = b"".join(parts)
    return found


class _Request(Transaction):
    """kazoo's ``Transaction``, serialized in one pass."""

    __slots__ = ()

    def serialize(self) -> bytes:
        parts: list[bytes] = []
        add = parts.append
        for op in self.operations:
            kind = op.type
            path = op.path.encode()
            add(multiheader_struct.pack(kind, False, -1))
            add(int_struct.pack(len(path)))
            add(path)
            if kind == Create.type:
                add(int_struct.pack(len(op.data)))
                add(op.data)
                add(_acl_bytes(op.acl))
                add(int_struct.pack(op.flags))
            elif kind == SetData.type:
                add(int_struct.pack(len(op.data)))
                add(op.data)
                add(int_struct.pack(op.version))
            else:   # Delete, CheckVersion: a version
                add(int_struct.pack(op.version))
        add(_END)
        return b"".join(parts)


class Multi:
    """The part of kazoo's ``TransactionRequest`` celery_zk's hot multis use.

    Paths must be absolute and normalized (as :class:`~celery_zk.zk.layout.Layout`
    builds them) and data bytes: nothing is checked here.
    """

    def __init__(self, client: KazooClient) -> None:
        self.client = client
        chroot = client.chroot or ""
        self._root = chroot.rstrip("/")
        self._acl = client.default_acl or OPEN_ACL_UNSAFE
        self.operations: list[Any] = []

    def check(self, path: str, version: int) -> None:
        self.operations.append(CheckVersion(self._root + path, version))

    def create(self, path: str, value: bytes = b"") -> None:
        self.operations.append(Create(self._root + path, value, self._acl, 0))

    def delete(self, path: str, version: int = -1) -> None:
        self.operations.append(Delete(self._root + path, version))

    def set_data(self, path: str, value: bytes, version: int = -1) -> None:
        self.operations.append(SetData(self._root + path, value, version))

    def commit_async(self) -> Any:
        return kazoo_compat.send(self.client, _Request(self.operations))

    def commit(self) -> list[Any]:
        return self.commit_async().get()
