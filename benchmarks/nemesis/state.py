"""What ZooKeeper holds at the end of a nemesis run, read from outside every partition.

* :func:`queue_leftovers`: every message still in a queue's ``owned/`` or
  ``unowned/`` after the final drain: stuck (the run healed, the workers ran
  on, and nothing took them);
* :func:`read_results`: each task's stored state, through the result backend;
* :func:`compare_members`: each member's own copy, read over a connection to
  that member alone after a ``sync``: the app's tree (paths, data, versions)
  hashed, ``mntr``'s znode count and ``srvr``'s zxid; equal on every member
  once nothing writes any more.
"""
from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable
from typing import Any

from celery import Celery
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.paths import join

from celery_zk.server import ZooKeeperEnsemble, four_letter_word
from celery_zk.zk.layout import Layout
from celery_zk.zk.message_names import parse_bucket_name
from celery_zk.zk.names import parse_consumer_name, unescape

BATCH = 1000


def _children(client: KazooClient, paths: list[str]) -> dict[str, list[str]]:
    replies = [(path, client.get_children_async(path)) for path in paths]
    found = {}
    for path, reply in replies:
        try:
            found[path] = reply.get()
        except NoNodeError:
            continue
    return found


def _leaves(client: KazooClient, top: str) -> list[str]:
    """Nodes without children under ``top`` (at any depth), ``top`` left out."""
    leaves: list[str] = []
    level = [top]
    while level:
        found = _children(client, level)
        level = []
        for path, names in found.items():
            if not names and path != top:
                leaves.append(path)
            level += [join(path, name) for name in names]
    return leaves


def queue_leftovers(client: KazooClient, root: str) -> dict[str, list[str]]:
    """{queue: messages still owned or waiting}, empty queues left out. Walked to any
    depth, so an inbox per consumer (``owned/{consumer}/...``) is looked into too;
    an empty bucket or inbox is not a message."""
    layout = Layout(root)
    try:
        queues = [unescape(name) for name in client.get_children(layout.queues)]
    except NoNodeError:
        return {}
    left: dict[str, list[str]] = {}
    for queue in queues:
        paths = [path for top in (layout.owned(queue), layout.unowned(queue))
                 for path in _leaves(client, top)
                 if not (parse_bucket_name(path.rpartition("/")[2])
                         or parse_consumer_name(path.rpartition("/")[2]))]
        if paths:
            left[queue] = sorted(paths)
    return left


def read_results(url: str, task_ids: Iterable[str]) -> dict[str, str | None]:
    """{task id: stored state, or None when nothing is stored}."""
    app = Celery("nemesis-check", backend=url, set_as_current=False)
    backend = app.backend
    ids = list(task_ids)
    states: dict[str, str | None] = {}
    try:
        for start in range(0, len(ids), BATCH):
            chunk = ids[start:start + BATCH]
            raw = backend.mget([backend.get_key_for_task(i) for i in chunk])
            for task_id, value in zip(chunk, raw):
                states[task_id] = backend.decode_result(value)["status"] if value else None
    finally:
        app.close()
    return states


def _tree_digest(client: KazooClient, root: str) -> tuple[str, int]:
    """A hash of every node under ``root`` (path, data, version) and their count."""
    digest = hashlib.sha256()
    count = 0
    level = [root]
    while level:
        reads = [(path, client.get_async(path), client.get_children_async(path))
                 for path in level]
        level = []
        for path, data_reply, children_reply in sorted(reads, key=lambda r: r[0]):
            try:
                data, stat = data_reply.get()
                children = children_reply.get()
            except NoNodeError:
                continue
            count += 1
            digest.update(f"{path}\0{stat.version}\0{stat.ephemeralOwner}\0".encode())
            digest.update(hashlib.sha256(data or b"").digest())
            level += [join(path, child) for child in children]
    return digest.hexdigest(), count


def _member_tree(host: str, port: int, root: str) -> dict[str, Any]:
    client = KazooClient(f"{host}:{port}", timeout=10)
    client.start(timeout=20)
    try:
        client.sync(root)   # this member has applied every write the leader committed
        digest, count = _tree_digest(client, root)
    finally:
        client.stop()
        client.close()
    return {"member": f"{host}:{port}", "tree_sha256": digest, "tree_nodes": count}


def _member_counters(host: str, port: int) -> dict[str, Any]:
    srvr = four_letter_word(host, port, "srvr")
    mntr = four_letter_word(host, port, "mntr")
    mode = re.search(r"^Mode: (\w+)", srvr, re.M)
    zxid = re.search(r"^Zxid: (\w+)", srvr, re.M)
    count = re.search(r"^zk_znode_count\s+(\d+)", mntr, re.M)
    return {"mode": mode.group(1) if mode else None, "zxid": zxid.group(1) if zxid else None,
            "znode_count": int(count.group(1)) if count else None}


def compare_members(ensemble: ZooKeeperEnsemble, root: str, attempts: int = 5
                    ) -> dict[str, Any]:
    """Each member's view; ``consistent`` when trees, znode counts and zxids agree.
    Read again a few times: a member may still be applying the last commits. The
    counters are read after our own connections closed (a session's open and
    close are transactions too)."""
    views: list[dict[str, Any]] = []
    for attempt in range(attempts):
        views = []
        for member in ensemble.members:
            try:
                views.append(_member_tree(member.host, member.client_port, root))
            except Exception as exc:
                views.append({"member": member.hosts, "error": repr(exc)})
        time.sleep(1)
        for member, view in zip(ensemble.members, views):
            try:
                view.update(_member_counters(member.host, member.client_port))
            except OSError as exc:
                view["error"] = repr(exc)
        agree = all(len({v.get(key) for v in views}) == 1 and views[0].get(key) is not None
                    for key in ("tree_sha256", "znode_count", "zxid"))
        if agree:
            return {"consistent": True, "attempts": attempt + 1, "members": views}
        time.sleep(2)
    return {"consistent": False, "attempts": attempts, "members": views}


def broadcast_reach(url: str, workers: Iterable[str], attempts: int = 3) -> dict[str, bool]:
    """{worker host: it answered a broadcast ``ping``}: a worker that does not no
    longer receives broadcasts (revokes included) on its pidbox queue."""
    app = Celery("nemesis-ping", broker=url, set_as_current=False)
    answered: set[str] = set()
    try:
        for _ in range(attempts):
            for reply in app.control.ping(timeout=3.0) or []:
                answered.update(name.partition("@")[0] for name in reply)
            if answered >= set(workers):
                break
    finally:
        app.close()
    return {worker: worker in answered for worker in workers}
