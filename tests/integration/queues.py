"""Reading a queue's waiting messages straight from ZooKeeper, as tests check them."""
from __future__ import annotations

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.paths import join

from celery_zk.broker.queue import creates
from celery_zk.zk.layout import Layout, parse_bucket_name, sort_messages


def buckets(zk_client: KazooClient, layout: Layout, queue: str) -> list[str]:
    """Paths of a queue's buckets, in delivery order."""
    try:
        names = zk_client.get_children(layout.unowned(queue))
    except NoNodeError:
        return []
    return [layout.bucket(queue, n) for n in sorted(names) if parse_bucket_name(n) is not None]


def waiting(zk_client: KazooClient, layout: Layout, queue: str) -> list[str]:
    """Names of every waiting message (and foreign node) of a queue, in delivery order."""
    try:
        names = [n for n in zk_client.get_children(layout.unowned(queue))
                 if parse_bucket_name(n) is None]
    except NoNodeError:
        return []
    for bucket in buckets(zk_client, layout, queue):
        try:
            names += zk_client.get_children(bucket)
        except NoNodeError:
            pass
    ordered, foreign = sort_messages(names)
    return ordered + foreign


def waiting_paths(zk_client: KazooClient, layout: Layout, queue: str) -> list[str]:
    return [layout.unowned_message(queue, n) for n in waiting(zk_client, layout, queue)]


def unowned_creations(zk_client: KazooClient, layout: Layout, queue: str) -> int:
    """How many messages were ever created in the queue's buckets."""
    return sum(creates(zk_client.exists(b)) for b in buckets(zk_client, layout, queue))


def first_bucket_path(zk_client: KazooClient, layout: Layout, queue: str) -> str:
    found = buckets(zk_client, layout, queue)
    assert found, f"queue {queue!r} has no bucket"
    return found[0]


__all__ = ["buckets", "first_bucket_path", "join", "unowned_creations", "waiting",
           "waiting_paths"]
