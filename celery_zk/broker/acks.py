"""Ending a claim: ack (acks held back briefly and sent a few hundred per
multi), requeue to its original place, reject (remove or dead-letter)."""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from kazoo.client import TransactionRequest
from kazoo.exceptions import (
    BadVersionError,
    ConnectionLoss,
    NodeExistsError,
    NoNodeError,
)

from ..zk.client import (
    RedoThread,
    log_failure,
    multi_failure,
)
from ..zk.config import ZKOptions
from ..zk.layout import (
    Layout,
    parse_message_name,
    requeued_name,
)
from .dead import wrap
from .store import ANY_VERSION, ClientSource, StoreBase

logger = logging.getLogger(__name__)

#: Most acks sent in one multi (a few dozen bytes each: far below jute.maxbuffer).
ACK_BATCH = 256

class Acking(StoreBase):
    """ack, requeue, remove: how an owned message leaves :class:`QueueStore`."""

    def __init__(self, source: ClientSource, layout: Layout, options: ZKOptions) -> None:
        super().__init__(source, layout, options)
        self._ack_retries: RedoThread[tuple[str, str]] = RedoThread(
            "celery_zk-ack-retry", self._ack_again)
        self._acks: list[tuple[str, str]] = []   # (owned path, consumer node) held back
        self._acks_lock = threading.Lock()

    def _ack_ops(self, owned_path: str, consumer_node: str) -> Callable[[TransactionRequest], None]:
        def build(txn: TransactionRequest) -> None:
            # The check makes an ack from an expired session a no-op: by then a
            # survivor may have requeued the message and another worker holds it.
            # Any version: the node's data (its queues) changes as consumers do.
            txn.check(consumer_node, ANY_VERSION)
            txn.delete(owned_path)
        return build

    def _ack_outcome(self, owned_path: str, consumer_node: str, results: list[Any]) -> bool:
        failure = multi_failure(results)
        if failure is None:
            return True
        if failure[0] == 0:
            logger.warning(
                "celery_zk: not acking %s: this worker's ZooKeeper session %s ended, so "
                "the message was requeued and will run again (at-least-once).",
                owned_path, consumer_node)
        return False

    def ack(self, owned_path: str, consumer_node: str) -> bool:
        """Delete an owned message if the session that claimed it still lives."""
        try:
            results = self.commit(self._ack_ops(owned_path, consumer_node))
        except NoNodeError:
            return False
        return self._ack_outcome(owned_path, consumer_node, results)

    def ack_async(self, owned_path: str, consumer_node: str) -> None:
        """:meth:`ack` without waiting for ZooKeeper, as AMQP's basic.ack.

        The task runs while the ack commits. It is sent after a short delay
        (:attr:`deferred`), so it does not hold up the task's own writes, and
        together with the other acks of that moment in one multi (a busy worker
        acks a prefetch's worth at a time). If the worker dies in between, the
        message is redelivered (at-least-once). If the reply is lost the ack is
        redone by a background thread that waits for the reconnect; until it
        lands the message stays owned, so nothing is lost either way.
        """
        with self._acks_lock:
            first = not self._acks
            self._acks.append((owned_path, consumer_node))
        if first:
            self.deferred.later(self._send_acks)

    def _send_acks(self) -> None:
        with self._acks_lock:
            acks, self._acks = self._acks, []
        by_owner: dict[str, list[str]] = {}
        for owned_path, consumer_node in acks:
            by_owner.setdefault(consumer_node, []).append(owned_path)
        for consumer_node, paths in by_owner.items():
            for start in range(0, len(paths), ACK_BATCH):
                self._send_ack_batch(consumer_node, paths[start:start + ACK_BATCH])

    def _send_ack_batch(self, consumer_node: str, paths: list[str]) -> None:
        """One multi: the owner's session is alive (the check), and every message goes."""
        txn = self.client.transaction()
        txn.check(consumer_node, ANY_VERSION)
        for owned_path in paths:
            txn.delete(owned_path)

        def done(result: Any) -> None:  # kazoo's event thread: never block here
            try:
                results = result.get()
            except Exception:
                for owned_path in paths:
                    self._ack_retries.submit((owned_path, consumer_node))
                return
            failure = multi_failure(results)
            if failure is None:
                return
            if failure[0] == 0:   # the session ended: every one of them was requeued
                for owned_path in paths:
                    self._ack_outcome(owned_path, consumer_node, results)
                return
            # One message was gone already (a requeue raced the ack, say), which
            # refused the whole multi: ack the others one by one.
            for index, owned_path in enumerate(paths, start=1):
                if index != failure[0]:
                    self._ack_retries.submit((owned_path, consumer_node))

        txn.commit_async().rawlink(done)

    def _ack_again(self, item: tuple[str, str]) -> None:
        owned_path, consumer_node = item
        try:
            self.ack(owned_path, consumer_node)
        except Exception as exc:  # the session's end will requeue it: at-least-once
            log_failure(logger, exc, "celery_zk: could not ack %s; it will be redelivered "
                        "when this worker's session ends", owned_path)

    def requeue(self, owned_path: str, data: bytes | None = None,
                expected_version: int = -1) -> bool:
        """Move an owned message back to unowned, ahead of newer messages of its priority.

        ``data=None`` reads it from the owned node (recovery of a dead owner).
        Returns False when the message was no longer there (acked, or requeued
        by someone else): the delete in the same transaction makes a double
        requeue impossible.
        """
        layout, client = self.layout, self.client
        queue, _, name = layout.split_owned_path(owned_path)
        message = parse_message_name(name)
        assert message is not None  # split_owned_path validated the name
        if data is None:
            try:
                data, stat = client.retry(client.get, owned_path)
            except NoNodeError:
                return False
            expected_version = stat.version
        # Not sequential: the uid makes the name unique (one copy of a message
        # exists at a time), and no bucket's counter moves.
        path = layout.unowned_message(queue, requeued_name(message))

        bucket = layout.parent(path)
        make_bucket = False

        def move() -> bool:
            nonlocal make_bucket
            txn = client.transaction()
            txn.delete(owned_path, version=expected_version)
            if make_bucket:
                txn.create(bucket)
            txn.create(path, data)
            try:
                failure = multi_failure(txn.commit())
            except ConnectionLoss:
                if client.retry(client.exists, owned_path) is None:
                    return True  # it committed (or another survivor moved it)
                raise
            if failure is None:
                return True
            index, error = failure
            if index == 1 and isinstance(error, NoNodeError if not make_bucket
                                         else NodeExistsError):
                # Its bucket was emptied and deleted since (make it again, in the
                # same transaction: it sorts ahead of later buckets, where the
                # message belongs), or made again meanwhile.
                make_bucket = not make_bucket
                return move()
            if isinstance(error, (NoNodeError, BadVersionError)):
                return False
            raise error

        return bool(client.retry(move))

    def remove(self, owned_path: str, dead_letter: bool, reason: str = "") -> bool:
        """Drop an owned message, or move it to the queue's dead/ directory."""
        layout, client = self.layout, self.client
        if not dead_letter:
            try:
                client.retry(client.delete, owned_path)
                return True
            except NoNodeError:
                return False
        queue, _, name = layout.split_owned_path(owned_path)
        return self._move_to_dead(owned_path, layout.dead_message(queue, name), reason)

    def discard(self, owned_path: str) -> None:
        """Delete an owned message without waiting for the reply (no_ack consumers)."""
        def done(result: Any) -> None:
            try:
                result.get()
            except NoNodeError:
                pass
            except Exception as exc:  # the owner's session end requeues it: at-least-once
                log_failure(logger, exc, "celery_zk: could not delete no-ack message %s",
                            owned_path)
        self.client.delete_async(owned_path).rawlink(done)

    def dead_letter_unowned(self, queue: str, name: str, reason: str) -> bool:
        """Move a node we cannot deliver out of the way, so it is not retried forever.
        ``name``: as listed (``bucket/name`` for a foreign node inside a bucket)."""
        return self._move_to_dead(self.layout.unowned_message(queue, name),
                                  self.layout.dead_message(queue, name), reason)

    def _move_to_dead(self, source: str, target: str, reason: str) -> bool:
        client = self.client
        try:
            data, stat = client.retry(client.get, source)
        except NoNodeError:
            return False

        def build(txn: TransactionRequest) -> None:
            txn.delete(source, version=stat.version)
            txn.create(target, wrap(data, reason))   # the reason is kept (celery_zk.broker.dead)

        failure = multi_failure(self.commit(build))
        if failure is None:
            logger.error("celery_zk: moved %s to %s: %s", source, target, reason)
            return True
        if isinstance(failure[1], NodeExistsError):  # a retry after it committed
            return False
        if isinstance(failure[1], (NoNodeError, BadVersionError)):
            return False
        raise failure[1]
