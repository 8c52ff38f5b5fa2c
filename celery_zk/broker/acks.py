"""Ending a delivery: ack (acks held back briefly and sent a few hundred per
multi), requeue to its original place, reject (remove or dead-letter).

An owned message is its name in its consumer's inbox and, for an ``n`` name,
its body in ``bodies/``. The ack deletes both in the multi that checks the
owner is alive; a requeue moves only the name back (the body never moved).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kazoo.client import KazooClient, KazooState, TransactionRequest
from kazoo.exceptions import (
    BadVersionError,
    ConnectionClosedError,
    ConnectionLoss,
    NodeExistsError,
    NoNodeError,
    SessionExpiredError,
)

from ..zk.client import (
    CONNECTION_ERRORS,
    RedoThread,
    log_failure,
    multi_failure,
)
from ..zk.message_names import MessageName, parse_message_name, requeued_name, without_body
from ..zk.multi import Multi
from . import big
from .dead import wrap
from .queues import ANY_VERSION, Queues

logger = logging.getLogger(__name__)

#: Most acks sent in one multi (two deletes of a few dozen bytes each).
ACK_BATCH = 256
#: Seconds an ack may wait to go with others. A consumer running low on work
#: sends the acks it holds at once (Inbox.fill): the dispatcher refills its
#: inbox only once it sees them; one with plenty to do sends them together.
ACK_HOLD = 0.05
#: Most messages moved back to wait in one multi (a dead consumer's inbox).
REQUEUE_BATCH = 128
#: Seconds between redos of an ack or delete whose connection was lost.
REDO_PAUSE = 1.0


class Acks:
    """ack, requeue, remove: how an owned message leaves its consumer's inbox."""

    def __init__(self, queues: Queues) -> None:
        self.queues = queues
        self.layout = queues.layout
        self._ack_retries: RedoThread[tuple[str, str]] = RedoThread(
            "celery_zk-ack-retry", self._ack_again)
        self._acks: list[tuple[str, str]] = []   # (owned path, consumer node) held back
        self._held_in: dict[str, int] = {}   # how many of those each inbox holds
        self._acks_lock = threading.Lock()
        # Held from taking the acks until their multis are queued: see send_held_acks.
        self._send_lock = threading.Lock()
        self._drops: RedoThread[str] = RedoThread("celery_zk-drop", self._drop_again)

    @property
    def client(self) -> KazooClient:
        return self.queues.client

    def body_of(self, owned_path: str) -> str:
        """Where an owned message's body lives."""
        queue, message = self._message(owned_path)
        return self.layout.body(queue, message)

    def _message(self, owned_path: str) -> tuple[str, MessageName]:
        queue, _, name = self.layout.split_owned_path(owned_path)
        message = parse_message_name(name)
        assert message is not None   # split_owned_path validated the name
        return queue, message

    def _big(self, owned_path: str) -> bool:
        return self._message(owned_path)[1].chunked

    def _delete_ops(self, txn: TransactionRequest | Multi, owned_path: str) -> None:
        """Add the deletes that end ``owned_path``: its name, then its body."""
        txn.delete(owned_path)
        txn.delete(self.body_of(owned_path))

    def ack(self, owned_path: str, consumer_node: str) -> bool:
        """Delete an owned message if the session that was given it still lives."""
        # The check makes an ack from an expired session a no-op: by then a
        # survivor may have requeued the message and another worker holds it.
        failure = self.queues.end(owned_path, *self._message(owned_path), check=consumer_node)
        if failure is not None and failure[0] == 0:
            self.not_acked(owned_path, consumer_node)
        return failure is None

    def not_acked(self, owned_path: str, consumer_node: str) -> None:
        logger.warning(
            "celery_zk: not acking %s: this worker's ZooKeeper session %s ended, so "
            "the message was requeued and will run again (at-least-once).",
            owned_path, consumer_node)

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
            inbox = owned_path.rpartition("/")[0]
            self._held_in[inbox] = self._held_in.get(inbox, 0) + 1
        if first:
            self.queues.deferred.later(self._send_acks, ACK_HOLD)

    def holds_acks(self, inbox: str) -> int:
        """How many acks of messages in ``inbox`` (a path) are held back."""
        return self._held_in.get(inbox, 0)

    def running_low(self, inbox: str, waiting: int, credit: int) -> None:
        """``inbox`` (a path) has ``waiting`` messages to deliver of ``credit``:
        when it runs low and what the dispatcher counts in it is above half its
        credit only because of acks held back, they go now, not in ACK_HOLD.
        The dispatcher refills the inbox only once it sees them, so the refill
        overlaps what is left instead of following it. Only then: an inbox
        that never fills (a worker's remote-control queue, looked at on every
        turn of its event loop; a trickle handed over one message at a time)
        sent every ack alone."""
        half = credit // 2
        if waiting <= half and waiting + self.holds_acks(inbox) > half:
            self.queues.deferred.flush()

    def acks_landed(self, timeout: float) -> bool:
        """Wait for the acks sent on the background thread (big messages, and
        retries after a lost reply): a connection that closes deletes its
        consumer node, which every one of them checks. False on timeout."""
        return self._ack_retries.join(timeout)

    def send_held_acks(self) -> None:
        """Queue every ack held back so far, before a request sent after this
        (a closing connection's delete of its consumer node, which each ack
        checks). Not :meth:`Deferred.flush` alone: a flush on another thread
        may have taken our send and not made it yet; then this waits for it."""
        self._send_acks()

    def _send_acks(self) -> None:
        with self._send_lock:
            with self._acks_lock:
                acks, self._acks = self._acks, []
                self._held_in = {}
            self._send(acks)

    def _send(self, acks: list[tuple[str, str]]) -> None:
        by_owner: dict[str, list[str]] = {}
        for owned_path, consumer_node in acks:
            if self._big(owned_path):   # its chunks: read, then deleted, on that thread
                self._ack_retries.submit((owned_path, consumer_node))
                continue
            by_owner.setdefault(consumer_node, []).append(owned_path)
        for consumer_node, paths in by_owner.items():
            for start in range(0, len(paths), ACK_BATCH):
                self._send_ack_batch(consumer_node, paths[start:start + ACK_BATCH])

    def _send_ack_batch(self, consumer_node: str, paths: list[str]) -> None:
        """One multi: the owner's session is alive (the check), and every message goes."""
        txn = Multi(self.client)   # the hot multi: serialized in one pass
        txn.check(consumer_node, ANY_VERSION)
        for owned_path in paths:
            self._delete_ops(txn, owned_path)   # two operations each

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
                    self.not_acked(owned_path, consumer_node)
                return
            # One message was gone already (a requeue raced the ack, say), which
            # refused the whole multi: ack the others one by one.
            gone = paths[(failure[0] - 1) // 2]
            for owned_path in paths:
                if owned_path != gone:
                    self._ack_retries.submit((owned_path, consumer_node))

        txn.commit_async().rawlink(done)

    def _ack_again(self, item: tuple[str, str]) -> None:
        owned_path, consumer_node = item
        try:
            self.ack(owned_path, consumer_node)
        except Exception as exc:  # the session's end will requeue it: at-least-once
            if not self._redo_later(self._ack_retries, item, exc):
                log_failure(logger, exc, "celery_zk: could not ack %s; it will be "
                            "redelivered when this worker's session ends", owned_path)

    def _drop_again(self, owned_path: str) -> None:
        try:
            self.remove(owned_path, dead_letter=False)
        except Exception as exc:  # the session's end requeues it: at-least-once
            if not self._redo_later(self._drops, owned_path, exc):
                log_failure(logger, exc, "celery_zk: could not delete no-ack message %s",
                            owned_path)

    def _redo_later(self, redo: RedoThread[Any], item: Any, exc: Exception) -> bool:
        """After a redo failed on a lost connection: submit it again (a second
        later, on the redo thread) while the session may live, so a message is
        not left owned by a live consumer for good (the nemesis found a no-ack
        broadcast so, its delete lost in a partition). False once the session
        ended (its messages are requeued) or the connection was closed."""
        if not isinstance(exc, CONNECTION_ERRORS) or isinstance(
                exc, (SessionExpiredError, ConnectionClosedError)):
            return False
        try:
            if self.client.state == KazooState.LOST:
                return False
        except CONNECTION_ERRORS:
            return False
        time.sleep(REDO_PAUSE)
        redo.submit(item)
        return True

    def requeue(self, owned_path: str) -> bool:
        """Move an owned message back to wait, ahead of newer messages of its
        priority: its name moves alone (its body stays where it was written).
        Returns False when the message was no longer there (acked, or requeued
        by someone else): the delete in the same transaction makes a double
        requeue impossible.
        """
        return self.queues.move(owned_path, self._waiting_again(owned_path))

    def _waiting_again(self, owned_path: str) -> str:
        """Where a requeued message waits: its own place in its bucket. Not
        sequential: the uid makes the name unique (one copy of a message exists
        at a time), and no bucket's counter moves."""
        queue, message = self._message(owned_path)
        return self.layout.unowned_message(queue, requeued_name(message))

    def requeue_many(self, owned_paths: list[str], settled: list[str] | None = None) -> int:
        """:meth:`requeue` for many messages, each to its place, their names
        moved :data:`REQUEUE_BATCH` per multi (a dead worker's inbox holds its
        credit, up to ``lookahead`` times its prefetch: one synced write each
        held up its recovery for seconds on a busy server). What a multi
        refuses (one moved already, its bucket gone, a lost reply) goes one at
        a time, as :meth:`requeue` does. Returns how many were moved. ``settled``, when
        given, gets each path whose fate is known as it becomes known (moved,
        or found not there): a caller dropping them from its own memory
        drops exactly those when a later one raises."""
        client = self.client
        done = settled.append if settled is not None else (lambda _path: None)
        moves = [(owned_path, self._waiting_again(owned_path)) for owned_path in owned_paths]
        moved = 0
        for start in range(0, len(moves), REQUEUE_BATCH):
            batch = moves[start:start + REQUEUE_BATCH]
            txn = client.transaction()
            for owned_path, path in batch:
                txn.create(path)   # before its delete, as in requeue()
                txn.delete(owned_path)
            try:
                committed = multi_failure(txn.commit()) is None
            except ConnectionLoss:
                committed = False   # looked at one by one: a moved one is not moved twice
            if committed:
                moved += len(batch)
            for owned_path, _ in batch:
                if not committed:
                    moved += self.requeue(owned_path)
                done(owned_path)
        return moved

    def remove(self, owned_path: str, dead_letter: bool, reason: str = "",
               expected: bool = False) -> bool:
        """Drop an owned message, or move it to the queue's dead/ directory;
        ``expected``: as its queue's arguments ask (logged at INFO, not ERROR)."""
        layout = self.layout
        queue, message = self._message(owned_path)
        if not dead_letter:
            failure = self.queues.end(owned_path, queue, message)
            if failure is None:
                return True
            if isinstance(failure[1], NoNodeError):
                return False
            raise failure[1]
        # Without a handed name's copy of its body: the dead node holds the body.
        name = without_body(layout.split_owned_path(owned_path)[2])
        return self._move_to_dead(owned_path, layout.dead_message(queue, name), reason,
                                  self.body_of(owned_path),
                                  (queue, message.uid) if message.chunked else None, expected)

    def discard(self, owned_path: str) -> None:
        """Delete an owned message without waiting for the reply (no_ack consumers)."""
        if self._big(owned_path):   # its chunks are read first: on a thread of ours
            self._drops.submit(owned_path)
            return

        def done(result: Any) -> None:   # kazoo's event thread: never block here
            try:
                failure = multi_failure(result.get())
                if failure is not None and not isinstance(failure[1], NoNodeError):
                    raise failure[1]
            except CONNECTION_ERRORS:
                self._drops.submit(owned_path)   # redone once connected (idempotent)
            except Exception as exc:  # the owner's session end requeues it: at-least-once
                log_failure(logger, exc, "celery_zk: could not delete no-ack message %s",
                            owned_path)
        txn = self.client.transaction()
        self._delete_ops(txn, owned_path)
        txn.commit_async().rawlink(done)

    def dead_letter_waiting(self, queue: str, name: str, reason: str) -> bool:
        """Move a waiting message (its name as listed, and its body) to dead/, as
        its queue's length asks; a node celery_zk did not write (``bucket/name``
        for one inside a bucket) alone, logged as an error."""
        source, target = self.layout.unowned_message(queue, name), self.layout.dead_message(
            queue, name)
        message = parse_message_name(name)
        if message is None:
            return self._move_to_dead(source, target, reason)
        return self._move_to_dead(source, target, reason, self.layout.body(queue, message),
                                  (queue, message.uid) if message.chunked else None, True)

    def _move_to_dead(self, source: str, target: str, reason: str,
                      body: str | None = None,
                      chunks_of: tuple[str, str] | None = None,
                      expected: bool = False) -> bool:
        """Move ``source`` (and its ``body``, whose data is the message then) to
        ``target``, keeping the message behind a reason line. A big message
        (``chunks_of``: its queue and uid) keeps its chunks where they are: the
        dead node holds its manifest, and the container is marked dead."""
        client = self.client
        try:
            data, stat = client.retry(client.get, body or source)
        except NoNodeError:
            return False

        def build(txn: TransactionRequest) -> None:
            if body is None:
                txn.delete(source, version=stat.version)
            else:
                txn.delete(source)
                txn.delete(body, version=stat.version)
            txn.create(target, wrap(data, reason))   # the reason is kept (celery_zk.broker.dead)
            if chunks_of is not None:
                big.mark(txn, self.layout, chunks_of[0], chunks_of[1], big.State.DEAD, data)

        failure = multi_failure(self.queues.commit(build))
        if failure is None:
            logger.log(logging.INFO if expected else logging.ERROR,
                       "celery_zk: moved %s to %s: %s", source, target, reason)
            return True
        if isinstance(failure[1], NodeExistsError):  # a retry after it committed
            return False
        if isinstance(failure[1], (NoNodeError, BadVersionError)):
            return False
        raise failure[1]
