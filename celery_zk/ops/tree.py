"""``celery zk tree``: a celery_zk tree as JSON, for support (zkutil's export_hierarchy).

Never a password: a digest ACL's id is ``user:base64(sha1(user:password))``, a
hash that can be attacked offline, so only the user is shown; URLs with a
password in node data are masked. Children are read in one pipelined round per
level: one round trip per level plus one per node's reply, not one per request.
See ``docs/operations.md``, "Support export: `celery zk tree`".
"""
from __future__ import annotations

import base64
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.paths import join

from ..zk.client import answered
from ..zk.config import mask_password

__all__ = ["export"]

_PERMS = ((1, "r"), (2, "w"), (4, "c"), (8, "d"), (16, "a"))


def export(client: KazooClient, path: str, data: bool = False) -> dict[str, Any]:
    """The tree under ``path`` (NoNodeError if there is none)."""
    root = _node(client, path, data)
    level = [root]
    while level:
        replies = [(node, client.get_children_async(node["path"])) for node in level]
        following = []
        for node, names in answered(replies):   # one deleted meanwhile: left out
            children = _nodes(client, [join(node["path"], name) for name in sorted(names)], data)
            node["children"] = children
            following.extend(children)
        level = following
    return root


def _node(client: KazooClient, path: str, data: bool) -> dict[str, Any]:
    nodes = _nodes(client, [path], data)
    if not nodes:
        raise NoNodeError(path)
    return nodes[0]


def _nodes(client: KazooClient, paths: list[str], data: bool) -> list[dict[str, Any]]:
    acls = [client.get_acls_async(path) for path in paths]
    reads = [client.get_async(path) for path in paths] if data else [None] * len(paths)
    out = []
    for path, acl_reply, read in zip(paths, acls, reads):
        try:
            acl, stat = acl_reply.get()
            value = read.get()[0] if read is not None else None
        except NoNodeError:
            continue
        node: dict[str, Any] = {
            "path": path,
            "acl": [_acl(entry) for entry in acl],
            "ctime": stat.ctime / 1000, "mtime": stat.mtime / 1000,
            "version": stat.version, "data_length": stat.dataLength,
            "num_children": stat.numChildren,
            "ephemeral_owner": f"0x{stat.ephemeralOwner:x}" if stat.ephemeralOwner else None,
        }
        if value is not None:
            node.update(_data(value))
        out.append(node)
    return out


def _acl(entry: Any) -> dict[str, str]:
    scheme, ident = entry.id.scheme, entry.id.id
    if scheme == "digest":
        ident = ident.partition(":")[0] + ":<password hash hidden>"
    perms = "".join(letter for bit, letter in _PERMS if entry.perms & bit)
    return {"scheme": scheme, "id": ident, "perms": perms}


def _data(value: bytes) -> dict[str, str]:
    try:
        return {"data": mask_password(value.decode("utf-8"))}
    except UnicodeDecodeError:
        return {"data_base64": base64.b64encode(value).decode("ascii")}
