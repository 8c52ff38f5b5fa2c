"""``celery zk upgrade``: messages stored before 0.2 (the body inside an ``m``
node, flat in ``unowned/`` or in a bucket, or claimed flat in ``owned/`` as
``{consumer}~{name}``), stored as every other one is.

Each moves in one multi: the old node deleted, its version checked so a
concurrent change fails it; its body and its name, requeued with its first
sequence in the bucket the old name states, so it keeps its place among its
priority. A claimed one moves only once its owner's session has ended (live,
it may still ack it). See ``docs/operations.md``, "To 0.4".
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kazoo.client import TransactionRequest
from kazoo.exceptions import NodeExistsError, NoNodeError

from ..broker.queues import Queues
from ..zk.client import children, multi_failure
from ..zk.message_names import MessageName, parse_bucket_name, parse_legacy_name, requeued_name
from ..zk.names import OWNER_SEP, parse_consumer_name, unescape

__all__ = ["Upgrade", "upgrade"]

logger = logging.getLogger(__name__)


@dataclass
class Upgrade:
    """What :func:`upgrade` found and did."""

    moved: dict[str, int] = field(default_factory=dict)     # queue -> messages stored anew
    owned_by_live: dict[str, int] = field(default_factory=dict)   # queue -> left: owner lives


def upgrade(queues: Queues) -> Upgrade:
    """Store every message of ``queues``' root kept in a form before 0.2 anew."""
    client, layout = queues.client, queues.layout
    done = Upgrade()
    live = {p for p in map(parse_consumer_name, children(client, layout.consumers)) if p}
    for escaped in children(client, layout.queues):
        queue = unescape(escaped)
        queues.declare(queue)   # the directories later releases added
        unowned = layout.unowned(queue)
        waiting = []
        for name in children(client, unowned):
            if parse_bucket_name(name) is None:
                waiting.append(f"{unowned}/{name}")
            else:
                bucket = layout.bucket(queue, name)
                waiting += [f"{bucket}/{child}" for child in children(client, bucket)]
        for path in waiting:
            message = parse_legacy_name(path.rpartition("/")[2])
            if message is not None and _store_anew(queues, queue, path, message):
                done.moved[queue] = done.moved.get(queue, 0) + 1
        owned = layout.owned(queue)
        for name in children(client, owned):
            owner, sep, rest = name.partition(OWNER_SEP)   # claimed flat by 0.1
            message = parse_legacy_name(rest) if sep else None
            if message is None:
                continue
            if owner in live:
                done.owned_by_live[queue] = done.owned_by_live.get(queue, 0) + 1
            elif _store_anew(queues, queue, f"{owned}/{name}", message):
                done.moved[queue] = done.moved.get(queue, 0) + 1
    return done


def _store_anew(queues: Queues, queue: str, old: str, message: MessageName) -> bool:
    """One multi: ``old`` goes, its body and its name (requeued, in its place)
    come; False when it was gone or changed meanwhile (then nothing was done)."""
    client, layout = queues.client, queues.layout
    try:
        data, stat = client.retry(client.get, old)
    except NoNodeError:
        return False
    bucket = layout.bucket(queue, message.bucket)
    missing = [path for path in (bucket, layout.body_bucket(queue, message.bucket))
               if client.retry(client.exists, path) is None]

    def build(txn: TransactionRequest) -> None:
        # Without one multi a crash between the steps would lose the message or
        # store it twice.
        txn.delete(old, version=stat.version)
        for path in missing:
            txn.create(path)
        txn.create(layout.body(queue, message), data)
        txn.create(f"{bucket}/{requeued_name(message)}")

    failure = multi_failure(queues.commit(build))
    if failure is None:
        return True
    if failure[0] > 0 and isinstance(failure[1], NodeExistsError):
        return _store_anew(queues, queue, old, message)   # a directory made meanwhile
    logger.warning("celery_zk: %s was not upgraded (%s); run the upgrade again",
                   old, type(failure[1]).__name__)
    return False
