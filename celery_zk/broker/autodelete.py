"""Auto-delete queues: held by the sessions that declared them, deleted when none is left.

Each declaring connection keeps an ephemeral holder under the queue's
``holders/``. Every delete must be guarded by deleting the empty
``holders/`` in the same transaction: a session that declares the queue
again at that moment adds a holder, the guard fails, and the queue stays.
See ``docs/design.md``, "Auto-delete queues".
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError, NotEmptyError

from ..zk.client import (
    CONNECTION_ERRORS,
    delete_if_there,
    log_failure,
    multi_failure,
    not_connected,
)
from ..zk.layout import Layout
from ..zk.session import AfterExpiry, ClientHandle
from ..zk.tree import DELETE_BATCH, list_tree
from .queues import Queues

logger = logging.getLogger(__name__)

#: A queue that keeps getting messages while being deleted is left to the next pass.
DELETE_ATTEMPTS = 3


def _session_id(client: KazooClient) -> int:
    client_id = client.client_id  # None while disconnected: retried until connected
    if client_id is None:
        raise not_connected(client)
    return int(client_id[0])


class Sweeper:
    """Deletes auto-delete queues nobody holds: the recovery leader's sweep, and a
    connection's own deletes at close."""

    def __init__(self, layout: Layout, queues: Queues) -> None:
        self.layout = layout
        self.queues = queues

    @property
    def client(self) -> KazooClient:
        return self.queues.client

    def sweep(self) -> int:
        """Delete every auto-delete queue without a holder. Returns how many.

        Run by the recovery leader when consumers come and go. One pipelined
        round of ``holders/`` listings, so many queues cost one round trip.
        """
        client = self.client
        pending = [(queue, client.get_children_async(self.layout.holders(queue)))
                   for queue in self.queues.queue_names()]
        deleted = 0
        for queue, result in pending:
            try:
                holders = result.get()
            except NoNodeError:
                continue  # not an auto-delete queue (or already gone)
            if not holders and self.delete_if_unheld(queue):
                deleted += 1
        if deleted:
            logger.info("celery_zk: deleted %d auto-delete queue(s) whose holders ended",
                        deleted)
        return deleted

    def delete_if_unheld(self, queue: str) -> bool:
        """Delete ``queue`` and its messages if its ``holders/`` is empty. True if deleted."""
        for _ in range(DELETE_ATTEMPTS):
            nodes = self._unheld_tree(queue)
            if nodes is None:
                return False
            try:
                # Big backlogs go in batches, each guarded by the empty holders/ (deleted
                # and re-made in the same transaction); the queue node is in the last.
                while len(nodes) > DELETE_BATCH:
                    batch, nodes = nodes[:DELETE_BATCH], nodes[DELETE_BATCH:]
                    self._guarded_delete(queue, batch, keep_holders=True)
                self._guarded_delete(queue, nodes, keep_holders=False)
                logger.debug("celery_zk: deleted auto-delete queue %r", queue)
                return True
            except _Held:
                return False
            except (NotEmptyError, NoNodeError):
                continue  # a message came or went meanwhile: list again
        logger.info("celery_zk: auto-delete queue %r kept changing; will try on the next pass",
                    queue)
        return False

    def _unheld_tree(self, queue: str) -> list[str] | None:
        """Every node of the queue, children first, but ``holders/`` (each batch's
        guard) and what is in it; None when the queue is not auto-delete, is held,
        or is gone."""
        client, holders = self.client, self.layout.holders(queue)
        try:
            if client.retry(client.get_children, holders):
                return None
        except NoNodeError:
            return None
        nodes = client.retry(list_tree, client, self.layout.queue(queue))
        if nodes is None:
            return None
        # holders/ is each batch's guard, deleted first in it (listed here too,
        # a second delete of it would fail every batch). A holder made since the
        # look above is not ours to delete: the guard fails on it (NotEmpty).
        return [node for node in nodes
                if node != holders and not node.startswith(holders + "/")]

    def _guarded_delete(self, queue: str, paths: Iterable[str], keep_holders: bool) -> None:
        client, holders = self.client, self.layout.holders(queue)

        def attempt() -> list[Any]:
            txn = client.transaction()
            txn.delete(holders)  # fails NotEmpty when a session holds the queue again
            if keep_holders:
                txn.create(holders)
            for path in paths:
                txn.delete(path)
            return txn.commit()

        failure = multi_failure(client.retry(attempt))
        if failure is None:
            return
        index, error = failure
        if index == 0 and isinstance(error, (NotEmptyError, NoNodeError)):
            raise _Held()  # held again, or deleted by someone else
        raise error


class _Held(Exception):
    """The queue has a holder again (or is gone): leave it."""


class AutoDeleteQueues(Sweeper):
    """The auto-delete queues one connection holds."""

    def __init__(self, handle: ClientHandle, layout: Layout, queues: Queues) -> None:
        super().__init__(layout, queues)
        self.handle = handle
        #: The queues this connection holds, with the data each was declared with.
        self.held: dict[str, bytes] = {}
        #: Call from any thread but kazoo's: holds every queue again after an expiry.
        self.restore = AfterExpiry(handle, self._restore)

    def _holder(self, client: KazooClient, queue: str) -> str:
        return self.layout.holder(queue, client.retry(_session_id, client), self.handle.token)

    def declare(self, queue: str, meta: bytes) -> None:
        """Declare ``queue`` (if needed) and hold it for this connection;
        ``meta``: its node's data (celery_zk.broker.queue_arguments.meta)."""
        client = self.handle.client
        for _ in range(DELETE_ATTEMPTS):
            holder = self._holder(client, queue)
            self.handle.own(holder)   # a connection dropped without close() deletes it too
            if self.queues.declare(queue, meta, holder=holder):
                break
            try:  # it existed: add our holder to it
                client.retry(client.create, holder, ephemeral=True)
                break
            except NodeExistsError:
                break  # a retried create: ours already
            except NoNodeError:
                if client.retry(client.exists, self.layout.queue(queue)) is not None:
                    logger.warning(
                        "celery_zk: queue %r exists as a durable queue; declared auto_delete "
                        "here, it stays durable (it is not deleted when this process ends). "
                        "Delete it or use another name to make it auto-delete.", queue)
                    return
                # swept between our two requests: declare it again
        self.held[queue] = meta

    def _restore(self, client: KazooClient) -> None:
        # The old session's holders went with it; a leader may even have deleted
        # the queues meanwhile (they had no holder): declare each one again.
        for queue, meta in list(self.held.items()):
            self.declare(queue, meta)
        if self.held:
            logger.info("celery_zk: holding %d auto-delete queue(s) again after session "
                        "expiry", len(self.held))

    def release_all(self) -> None:
        """Clean close: drop this connection's holders; delete the queues nobody else holds."""
        client = self.handle.client
        try:
            for queue in list(self.held):
                holder = self._holder(client, queue)
                delete_if_there(client, holder)
                self.handle.disown(holder)
                self.delete_if_unheld(queue)
        except CONNECTION_ERRORS as exc:
            # Closing anyway: releasing the lease deletes the holders it still owns
            # (or the session's end does), and the recovery leader sweeps.
            log_failure(logger, exc, "celery_zk: auto-delete queues left to the recovery "
                        "leader")
        self.held.clear()
