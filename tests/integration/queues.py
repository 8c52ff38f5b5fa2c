"""Reading a queue's waiting messages straight from ZooKeeper, as tests check them."""
from __future__ import annotations

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.paths import join
from kazoo.protocol.states import ZnodeStat

from celery_zk.broker.queues import creates
from celery_zk.zk.layout import Layout
from celery_zk.zk.message_names import parse_bucket_name, parse_message_name, sort_messages
from celery_zk.zk.payload import read_payload


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


def body_path(layout: Layout, queue: str, name: str) -> str:
    """Where a waiting message's body is: in bodies/ (a foreign node: in itself)."""
    message = parse_message_name(name)
    return layout.body(queue, message) if message else layout.unowned_message(queue, name)


def stored_body(zk_client: KazooClient, layout: Layout, queue: str,
                name: str) -> tuple[bytes, ZnodeStat]:
    """``(data, stat)`` of a waiting message's body (a big one's read from its chunks)."""
    data, stat = zk_client.get(body_path(layout, queue, name))
    message = parse_message_name(name)
    if message is not None and message.chunked:
        data = read_payload(zk_client, layout.chunk_container(queue, message.uid), data)
    return data, stat


def unowned_creations(zk_client: KazooClient, layout: Layout, queue: str) -> int:
    """How many messages were ever created in the queue's buckets."""
    return sum(creates(zk_client.exists(b)) for b in buckets(zk_client, layout, queue))


def owned(zk_client: KazooClient, layout: Layout, queue: str) -> list[str]:
    """Paths of every owned message of a queue, in its consumers' inboxes."""
    try:
        names = zk_client.get_children(layout.owned(queue))
    except NoNodeError:
        return []
    found = []
    for name in names:
        try:
            found += [layout.inbox_message(queue, name, entry)
                      for entry in zk_client.get_children(layout.inbox(queue, name))]
        except NoNodeError:
            pass
    return found


def owners(zk_client: KazooClient, layout: Layout, queue: str) -> list[str]:
    """The consumer id of each owned message of a queue."""
    return [layout.split_owned_path(path)[1] for path in owned(zk_client, layout, queue)]


def first_bucket_path(zk_client: KazooClient, layout: Layout, queue: str) -> str:
    found = buckets(zk_client, layout, queue)
    assert found, f"queue {queue!r} has no bucket"
    return found[0]


__all__ = ["body_path", "buckets", "first_bucket_path", "join", "owned", "owners",
           "stored_body", "unowned_creations", "waiting", "waiting_paths"]
