"""The queue protocol: put, claim, ack, requeue, dead-letter, purge.

Every state change that touches more than one node is one ``multi``
transaction, so a message is always in exactly one place (unowned, owned or
dead) whatever crashes in between. Operations are retried after
ConnectionLoss; because a lost reply does not say whether a transaction
committed, each retry first checks for the effect it was about to cause.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import (
    BadVersionError,
    ConnectionLoss,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
)

from .client import Deferred, RedoThread, create_once, log_failure, multi_failure, reply_or_retry
from .config import ZKOptions
from .exceptions import MessageTooLarge
from .layout import (
    Layout,
    message_prefix,
    owned_name,
    parse_message_name,
    sort_messages,
    unescape,
)

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Claimed:
    """A message this consumer now owns."""

    queue: str
    name: str          # unowned name it had
    owned_path: str    # where it lives while owned (the delivery tag)
    data: bytes


@dataclass(frozen=True)
class NewMessage:
    """A message about to be published."""

    queue: str
    uid: str      # the unique part of its name: finds it after a lost reply
    path: str     # the sequential node's prefix
    data: bytes


def new_uid() -> str:
    return uuid.uuid4().hex[:16]


class ClientSource(Protocol):
    """Where a store gets its client (a new one after fork) and held-back writes:
    a :class:`~celery_zk.session.ClientHandle` or a whole session."""

    @property
    def client(self) -> KazooClient: ...

    @property
    def deferred(self) -> Deferred: ...


class QueueStore:
    """Queue operations for one kazoo client under one root."""

    def __init__(self, source: ClientSource, layout: Layout, options: ZKOptions) -> None:
        self.source = source
        self.layout = layout
        self.options = options
        self._ack_retries: RedoThread[tuple[str, str]] = RedoThread(
            "celery_zk-ack-retry", self._ack_again)

    @property
    def client(self) -> KazooClient:
        return self.source.client

    @property
    def deferred(self) -> Deferred:
        """Acks and offers wait here briefly (see Deferred): off the critical path.
        One per session, so a publish flushes what any user of it held back."""
        return self.source.deferred

    def commit(self, build: Callable[[TransactionRequest], None]) -> list[Any]:
        """Build and commit a transaction, rebuilt per retry (kazoo commits one once)."""
        client = self.client

        def attempt() -> list[Any]:
            txn = client.transaction()
            build(txn)
            return txn.commit()

        return client.retry(attempt)

    # -- declaration ------------------------------------------------------------
    def declare(self, queue: str, meta: bytes = b"{}", holder: str | None = None) -> bool:
        """Create the queue's directories; a no-op when they exist (idempotent).

        ``holder`` (auto-delete queues) is the declaring session's ephemeral
        node under ``holders/``, created in the same transaction, so the queue
        is never without a holder a sweeper could mistake for dead. Returns
        False when the queue already existed (nothing was created).
        """
        layout, client = self.layout, self.client
        client.retry(client.ensure_path, layout.queues)

        def build(txn: TransactionRequest) -> None:
            txn.create(layout.queue(queue), meta)
            for path in layout.queue_directories(queue):
                txn.create(path)
            if holder is not None:
                txn.create(layout.holders(queue))
                txn.create(holder, ephemeral=True)

        failure = multi_failure(self.commit(build))
        if failure and not isinstance(failure[1], NodeExistsError):
            raise failure[1]
        return failure is None

    def exists(self, queue: str) -> bool:
        return self.client.retry(self.client.exists, self.layout.unowned(queue)) is not None

    def size(self, queue: str) -> int:
        """Messages waiting, from the directory's stat alone (no listing)."""
        stat = self.client.retry(self.client.exists, self.layout.unowned(queue))
        return stat.numChildren if stat else 0

    # -- publishing ---------------------------------------------------------------
    def check_size(self, data: bytes, what: str) -> None:
        limit = self.options.max_message_size
        if len(data) > limit:
            raise MessageTooLarge(
                f"{what} is {len(data):,} bytes; a ZooKeeper node holds at most "
                f"{limit:,} (option max_message_size; the server's jute.maxbuffer caps "
                "it near 1 MiB). Nothing was written. Send a reference to the data "
                "(a path or URL) instead of the data itself.")

    def put(self, queue: str, data: bytes, priority: int | None) -> str:
        """Append a message; returns its node name."""
        return self.put_new(self.new_message(queue, data, priority))

    def new_message(self, queue: str, data: bytes, priority: int | None) -> NewMessage:
        """A message ready to publish (its size checked, its node named)."""
        self.check_size(data, f"A message for queue {queue!r}")
        uid = new_uid()
        # ZooKeeper appends the sequence to this prefix.
        path = self.layout.unowned_message(queue, message_prefix(priority, uid))
        return NewMessage(queue, uid, path, data)

    def put_new(self, message: NewMessage, maybe_made: bool = False) -> str:
        """Create ``message``'s node once (``maybe_made``: an earlier create lost its reply)."""
        try:
            return self._create_once(message, maybe_made)
        except NoNodeError:
            self.declare(message.queue)  # first message to an undeclared queue
            return self._create_once(message, maybe_made)

    def _create_once(self, message: NewMessage, maybe_made: bool) -> str:
        client = self.client
        return create_once(
            client, lambda: client.create(message.path, message.data,
                                          sequence=True).rpartition("/")[2],
            lambda: self._find_uid(message.queue, message.uid), maybe_made)

    def _find_uid(self, queue: str, uid: str) -> str | None:
        for name in self.client.get_children(self.layout.unowned(queue)):
            parsed = parse_message_name(name)
            if parsed and parsed.uid == uid:
                return name
        return None

    # -- consuming ----------------------------------------------------------------
    def listing(self, queue: str, watch: Callable[[Any], None] | None = None
                ) -> tuple[list[str], list[str]]:
        """(messages in delivery order, foreign node names) of a queue."""
        client = self.client
        path = self.layout.unowned(queue)
        while True:
            try:
                names = client.retry(client.get_children, path, watch=watch)
            except NoNodeError:
                # No listing watch on a missing node: watch for its creation instead
                # (a deleted auto-delete queue its owner re-declares after an expiry).
                if watch is None or client.retry(client.exists, path, watch=watch) is None:
                    return [], []
                continue  # created meanwhile: list it
            return sort_messages(names)

    def read_async(self, queue: str, name: str) -> Any:
        """Start reading a waiting message (non-blocking: a watch callback may call it)."""
        return self.client.get_async(self.layout.unowned_message(queue, name))

    def read_owned_async(self, queue: str, name: str) -> Any:
        """Start reading an owned message (non-blocking: a watch callback may call it)."""
        return self.client.get_async(self.layout.owned_message(queue, name))

    def read_owned(self, owned_path: str) -> tuple[bytes, Any]:
        client = self.client
        return client.retry(client.get, owned_path)

    def claim(self, queue: str, names: list[str], consumer_id: str,
              reads: dict[str, Any] | None = None) -> tuple[list[Claimed], set[str]]:
        """Move ``names`` from unowned to owned in one transaction.

        ``reads``: reads of some of them already under way (:meth:`read_async`).
        Returns what was claimed and the names another consumer took first.
        """
        layout, client = self.layout, self.client
        gone: set[str] = set()
        reads = reads or {}
        pending = [(n, reads.pop(n, None) or client.get_async(layout.unowned_message(queue, n)))
                   for n in names]
        candidates: list[tuple[str, bytes, int]] = []
        for name, result in pending:
            try:
                data, stat = reply_or_retry(client, result, client.get,
                                            layout.unowned_message(queue, name))
            except NoNodeError:
                gone.add(name)
            else:
                candidates.append((name, data, stat.version))
        while candidates:
            txn = client.transaction()
            for name, data, version in candidates:
                # Without the transaction a crash between delete and create would
                # lose the message; with it the message is unowned or owned, never neither.
                txn.delete(layout.unowned_message(queue, name), version=version)
                txn.create(layout.owned_message(queue, owned_name(consumer_id, name)), data)
            try:
                results = txn.commit()
            except ConnectionLoss:
                # Did it commit? The first create tells (the multi is all or nothing).
                first = layout.owned_message(queue, owned_name(consumer_id, candidates[0][0]))
                if client.retry(client.exists, first) is None:
                    continue
                results = []
            failure = multi_failure(results)
            if failure is None:
                return [Claimed(queue, name, layout.owned_message(
                    queue, owned_name(consumer_id, name)), data)
                    for name, data, _ in candidates], gone
            index, error = failure
            if not isinstance(error, (NoNodeError, BadVersionError, NodeExistsError)):
                raise error
            gone.add(candidates.pop(index // 2)[0])  # two ops per candidate
        return [], gone

    def _ack_ops(self, owned_path: str, consumer_node: str) -> Callable[[TransactionRequest], None]:
        def build(txn: TransactionRequest) -> None:
            # The check makes an ack from an expired session a no-op: by then a
            # survivor may have requeued the message and another worker holds it.
            txn.check(consumer_node, 0)
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
        (:attr:`deferred`), so it does not hold up the task's own writes; if
        the worker dies in between, the message is redelivered (at-least-once).
        If the reply is lost the ack is redone by a background thread that
        waits for the reconnect; until it lands the message stays owned, so
        nothing is lost either way.
        """
        self.deferred.later(lambda: self._send_ack(owned_path, consumer_node))

    def _send_ack(self, owned_path: str, consumer_node: str) -> None:
        txn = self.client.transaction()
        self._ack_ops(owned_path, consumer_node)(txn)

        def done(result: Any) -> None:  # kazoo's event thread: never block here
            try:
                self._ack_outcome(owned_path, consumer_node, result.get())
            except NoNodeError:
                pass
            except Exception:
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
        path = layout.unowned_message(queue, message_prefix(
            message.priority, message.uid, message.order))

        def move() -> bool:
            txn = client.transaction()
            txn.delete(owned_path, version=expected_version)
            txn.create(path, data, sequence=True)
            try:
                failure = multi_failure(txn.commit())
            except ConnectionLoss:
                if client.retry(client.exists, owned_path) is None:
                    return True  # it committed (or another survivor moved it)
                raise
            if failure is None:
                return True
            if isinstance(failure[1], (NoNodeError, BadVersionError)):
                return False
            raise failure[1]

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
        """Move a node we cannot deliver out of the way, so it is not retried forever."""
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
            txn.create(target, data)

        failure = multi_failure(self.commit(build))
        if failure is None:
            logger.error("celery_zk: moved %s to %s: %s", source, target, reason)
            return True
        if isinstance(failure[1], NodeExistsError):  # a retry after it committed
            return False
        if isinstance(failure[1], (NoNodeError, BadVersionError)):
            return False
        raise failure[1]

    # -- maintenance --------------------------------------------------------------
    def purge(self, queue: str) -> int:
        """Delete every waiting (unowned) message; owned ones are being worked on."""
        client, layout = self.client, self.layout
        try:
            names = client.retry(client.get_children, layout.unowned(queue))
        except NoNodeError:
            return 0
        removed = 0
        results = [(n, client.delete_async(layout.unowned_message(queue, n))) for n in names]
        for _, result in results:
            try:
                result.get()
                removed += 1
            except NoNodeError:
                pass  # claimed or purged by someone else meanwhile
        return removed

    def delete(self, queue: str) -> None:
        """Remove a queue and everything in it (messages included)."""
        client = self.client
        for _ in range(5):
            try:
                client.retry(client.delete, self.layout.queue(queue), recursive=True)
                return
            except NoNodeError:
                return
            except NotEmptyError:  # a message arrived while deleting; go again
                continue

    def owned_listing(self, queue: str) -> list[str]:
        client = self.client
        try:
            return client.retry(client.get_children, self.layout.owned(queue))
        except NoNodeError:
            return []

    def queue_names(self) -> Iterable[str]:
        client = self.client
        try:
            return [unescape(n) for n in client.retry(client.get_children, self.layout.queues)]
        except NoNodeError:
            return []
