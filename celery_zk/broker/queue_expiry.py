"""Queues with ``x-expires`` go once unused, as RabbitMQ's do.

A queue's node was last written when it was last known used: a declaration
writes it again, and so does the elected round (:mod:`celery_zk.zk.rounds`)
that first finds it without consumers although its ``consumers/`` changed
(``pzxid``) after that write (``mzxid``); a round that finds no consumer and
no change since an ``x-expires``-old write deletes the queue. The zxids
order a consumer's coming and going against the write, so a queue never goes
before its ``x-expires``. See ``docs/configuration.md``, "Queue arguments".
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from kazoo.exceptions import BadVersionError, NoNodeError

from ..zk.rounds import Rounds
from .bindings import Bindings
from .queue_arguments import Limits
from .queues import Queues

__all__ = ["expire_unused", "start", "stop_all", "touch"]

logger = logging.getLogger(__name__)

_running: dict[tuple[int, str, str], QueueExpiry] = {}   # (pid, hosts, root) ->


def touch(queues: Queues, queue: str) -> None:
    """A declaration of an existing queue with ``x-expires``: used now."""
    client, path = queues.client, queues.layout.queue(queue)
    try:
        data, stat = client.retry(client.get, path)
    except NoNodeError:
        return
    _used_now(client, path, data, stat.version)


def _used_now(client: Any, path: str, data: bytes, version: int) -> None:
    """Write a queue's node again (its data as it is): its last use is now."""
    try:
        client.retry(client.set, path, data, version)
    except (NoNodeError, BadVersionError):
        pass   # deleted, or written by someone else meanwhile: as good


def expire_unused(queues: Queues, bindings: Bindings, now: float) -> list[str]:
    """One round's look at every queue (see the module docstring); the queues
    it deleted."""
    client, layout = queues.client, queues.layout
    names = list(queues.queue_names())
    nodes = [client.get_async(layout.queue(q)) for q in names]
    crowds = [client.exists_async(layout.queue_consumers(q)) for q in names]
    deleted = []
    for queue, node, crowd in zip(names, nodes, crowds):
        try:
            data, stat = node.get()
            consumers = crowd.get()
        except NoNodeError:
            continue   # deleted meanwhile
        limits = Limits.stored(data)
        if limits.expires is None or limits.temporary:
            continue
        if consumers is not None and consumers.numChildren:
            continue   # in use
        if consumers is not None and consumers.pzxid > stat.mzxid:
            # Its last consumer left since the last write: unused from now.
            _used_now(client, layout.queue(queue), data, stat.version)
            continue
        if now - stat.mtime / 1000 < limits.expires:
            continue
        waiting = queues.size(queue)
        for exchange, routing_key in bindings.bindings_of_queue(queue):
            bindings.unbind(exchange, queue, routing_key)
        queues.delete(queue)
        deleted.append(queue)
        logger.info("celery_zk: queue %r deleted: unused for its x-expires of %g ms "
                    "(%d waiting message(s) went with it)", queue, limits.expires * 1000,
                    waiting)
    return deleted


class QueueExpiry:
    """The rounds of one root in this process, on its newest consuming connection."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport   # replaced by a reconnect's (see start)
        layout = transport.layout
        self.rounds = Rounds("unused queues", transport.settings.options.expire_every,
                             layout.queues, layout.queues_expirer,
                             lambda: self.transport.handle.client, self.run)

    def run(self) -> list[str]:
        return expire_unused(self.transport.queues, self.transport.bindings, time.time())


def start(transport: Any) -> None:
    """A worker's consuming connection: its process takes part in the rounds
    (``expire_every`` 0: none)."""
    if transport.settings.options.expire_every <= 0:
        return
    key = (os.getpid(), transport.settings.hosts, transport.layout.root)
    running = _running.get(key)
    if running is not None:
        running.transport = transport
        return
    _running[key] = QueueExpiry(transport)
    _running[key].rounds.start()


def stop_all() -> None:
    """The worker shuts down."""
    while _running:
        _running.popitem()[1].rounds.stop()
