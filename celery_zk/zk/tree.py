"""Deleting a subtree: listed with pipelined reads, deleted in as few transactions as fit.

Each level is listed in one round trip, and the nodes go children first in
multis of at most :data:`DELETE_BATCH` deletes: a tree that fits in one goes
at once or not at all (kazoo's recursive delete took a synced write and a
round trip per node, and a crash left half a queue). See ``docs/design.md``,
"Deleting a queue or an exchange".
"""
from __future__ import annotations

import logging

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError, NotEmptyError

from .client import multi_failure

logger = logging.getLogger(__name__)

#: Most deletes per transaction (a multi is one request, capped by the
#: server's jute.maxbuffer; this stays far below it).
DELETE_BATCH = 500
#: Most listings in flight at once (a queue's backlog has one node per message).
LIST_PIPELINE = 1000
#: A tree that keeps changing while it is deleted is listed again this often.
ATTEMPTS = 5


def list_tree(client: KazooClient, path: str) -> list[str] | None:
    """``path`` and every node below it, children before their parents; None
    when ``path`` does not exist. One round trip per level of the tree."""
    levels: list[list[str]] = []
    level = [path]
    while level:
        levels.append(level)
        below: list[str] = []
        for start in range(0, len(level), LIST_PIPELINE):
            listings = [(parent, client.get_children_async(parent))
                        for parent in level[start:start + LIST_PIPELINE]]
            for parent, listing in listings:
                try:
                    below += [f"{parent}/{child}" for child in listing.get()]
                except NoNodeError:   # deleted since its parent was listed
                    if parent == path:
                        return None
                    # Below the top: its delete fails NoNode, and the tree is listed again.
        level = below
    return [node for level in reversed(levels) for node in level]


def delete_tree(client: KazooClient, path: str) -> bool:
    """Delete ``path`` and everything below it. False when it did not exist.

    A node created or deleted below it meanwhile fails the transaction it
    falls in (NotEmpty, NoNode): the tree is listed again, up to
    :data:`ATTEMPTS` times, then left with a warning.
    """
    for _ in range(ATTEMPTS):
        nodes = client.retry(list_tree, client, path)
        if nodes is None:
            return False
        try:
            for start in range(0, len(nodes), DELETE_BATCH):
                _delete_all(client, nodes[start:start + DELETE_BATCH])
            return True
        except NoNodeError:
            if client.retry(client.exists, path) is None:
                return True   # deleted by someone else meanwhile
        except NotEmptyError:
            pass
    logger.warning("celery_zk: %s kept changing while being deleted (%d attempts); "
                   "some of it is still there: delete it again", path, ATTEMPTS)
    return True


def _delete_all(client: KazooClient, paths: list[str]) -> None:
    def attempt() -> list[object]:
        txn = client.transaction()
        for node in paths:
            txn.delete(node)
        return txn.commit()

    failure = multi_failure(client.retry(attempt))
    if failure is not None:
        raise failure[1]
