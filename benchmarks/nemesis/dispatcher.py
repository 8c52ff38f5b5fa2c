"""Which worker holds a queue's dispatcher role: the nemesis's favoured target.

A lookup is a function ``(client, root, queue) -> [pid, ...]``: the processes
of a directory of live-consumer nodes, the oldest (the holder) first; the
next ones hold it after the holder's node goes (a process killed a moment
ago keeps its node until its session expires). Today the
role that matters is the recovery leader (the oldest of ``{root}/consumers/``
by consumer id, the rule of ``celery_zk.broker.liveness``); once a per-queue
dispatcher is elected among a queue's consumers (issue 26) it is the oldest
of ``{root}/queues/{queue}/consumers/`` (by creation, ``czxid``, whatever the
names). ``auto`` picks the second when that directory exists.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.paths import join

from celery_zk.zk.layout import Layout
from celery_zk.zk.names import parse_consumer_name

Lookup = Callable[[KazooClient, str, str], "list[int]"]


def _pid_of(client: KazooClient, layout: Layout, name: str, data: bytes) -> int | None:
    """The pid a consumer node's data names; else the pid of the consumer its name
    begins with (an election node may carry only the consumer id)."""
    try:
        meta: Any = json.loads(data or b"{}")
    except ValueError:
        meta = {}
    if isinstance(meta, dict) and isinstance(meta.get("pid"), int):
        return int(meta["pid"])
    consumer = parse_consumer_name(name.partition("~")[0])
    if consumer is None:
        return None
    try:
        data, _ = client.get(layout.consumer(consumer))
        meta = json.loads(data or b"{}")
    except (NoNodeError, ValueError):
        return None
    return int(meta["pid"]) if isinstance(meta, dict) and "pid" in meta else None


def _by_age(client: KazooClient, root: str, path: str, by_name: bool) -> list[int]:
    try:
        names = client.get_children(path)
    except NoNodeError:
        return []
    replies = [(name, client.get_async(join(path, name))) for name in names]
    nodes = []
    for name, reply in replies:
        try:
            data, stat = reply.get()
        except NoNodeError:
            continue   # gone meanwhile
        if by_name and parse_consumer_name(name) is None:
            continue
        nodes.append((name if by_name else stat.czxid, name, data))
    pids = []
    for _, name, data in sorted(nodes):
        pid = _pid_of(client, Layout(root), name, data)
        if pid is not None and pid not in pids:
            pids.append(pid)
    return pids


def recovery_leader(client: KazooClient, root: str, queue: str) -> list[int]:
    """Today: the process of the oldest consumer id under ``{root}/consumers``."""
    return _by_age(client, root, Layout(root).consumers, by_name=True)


def queue_dispatcher(client: KazooClient, root: str, queue: str) -> list[int]:
    """After issue 26: the oldest node under ``{root}/queues/{queue}/consumers``."""
    return _by_age(client, root, Layout(root).queue_consumers(queue), by_name=False)


def auto(client: KazooClient, root: str, queue: str) -> list[int]:
    if client.exists(Layout(root).queue_consumers(queue)):
        return queue_dispatcher(client, root, queue)
    return recovery_leader(client, root, queue)


LOOKUPS: dict[str, Lookup] = {"auto": auto, "recovery-leader": recovery_leader,
                              "queue-consumers": queue_dispatcher}
