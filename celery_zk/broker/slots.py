"""A running task holds its concurrency slot whatever its ack mode.

A task acked as it starts, whose task has a concurrency limit, is acked into
a *slot*: one multi deletes the message (name and body) and makes ``~{name}``
in the same inbox, which the dispatcher counts as it counts the names there.
The slot goes when the pool says the task ended
(:func:`celery_zk.compat.celery_pool.track_task_ends`) or with its
consumer's session (recovery deletes slots and requeues only messages). A
late ack comes after the task's end: a plain ack. See ``docs/features.md``,
"Cluster-wide rate and concurrency limits".
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from kazoo.exceptions import NoNodeError

from ..zk.client import CONNECTION_ERRORS, log_failure, multi_failure, unwaited
from ..zk.message_names import SLOT, parse_message_name

__all__ = ["SLOTS", "Slots"]

logger = logging.getLogger(__name__)

#: Tags of tasks whose end came before their acceptance (billiard may report
#: them so) that a process remembers: the acceptance that follows is ignored.
ENDED_FIRST = 1024


class Slots:
    """The tasks of this process's pools, by delivery tag (an owned path), and
    the slots their early acks made."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[str] = set()      # accepted by a pool, not ended
        self._ended_first: set[str] = set()  # ended before their acceptance was told
        self._held: dict[str, tuple[Any, str, Any]] = {}   # tag -> client, slot, multi

    # -- what the pools say (celery_zk.compat.celery_pool.TaskEnds) --------------------
    @staticmethod
    def wants(delivery_tag: str) -> bool:
        """Only a message whose name carries its task's token may have a
        concurrency limit (every other task's start and end cost nothing)."""
        message = parse_message_name(delivery_tag.rpartition("/")[2])
        return message is not None and message.task is not None

    def accepted(self, delivery_tag: str) -> None:
        with self._lock:
            if delivery_tag in self._ended_first:
                self._ended_first.discard(delivery_tag)
            else:
                self._running.add(delivery_tag)

    def ended(self, delivery_tag: str) -> None:
        with self._lock:
            if delivery_tag not in self._running:
                if len(self._ended_first) >= ENDED_FIRST:
                    self._ended_first.clear()
                self._ended_first.add(delivery_tag)
                return
            self._running.discard(delivery_tag)
            held = self._held.pop(delivery_tag, None)
        if held is not None:
            _release(*held)

    # -- the consuming connection's acks -------------------------------------------------
    def ack(self, transport: Any, delivery_tag: str, consumer_node: str) -> bool:
        """Ack a running task of a concurrency-limited task into its slot (see
        above); False when that is not the case (a plain ack is the caller's)."""
        if delivery_tag not in self._running:   # the pools' own: no lock needed to look
            return False
        layout = transport.layout
        queue, consumer, name = layout.split_owned_path(delivery_tag)
        message = parse_message_name(name)
        if message is None or message.task is None or message.chunked or not any(
                limit.concurrency and limit.token == message.task
                for limit in transport.limits()):
            return False
        client = transport.handle.client
        slot = layout.inbox_message(queue, consumer, SLOT + name)
        txn = client.transaction()
        # The check: an ack from an ended session must not delete what a
        # survivor requeued meanwhile (as a plain ack's). The slot before the
        # name goes: the dispatcher, told of each in turn, never sees neither.
        txn.check(consumer_node, -1)
        txn.create(slot)
        txn.delete(delivery_tag)
        txn.delete(transport.acks.body_of(delivery_tag))
        result = txn.commit_async()
        result.rawlink(lambda done: _committed(done, transport, delivery_tag, consumer_node))
        with self._lock:
            if delivery_tag in self._running:
                self._held[delivery_tag] = (client, slot, result)
                return True
        _release(client, slot, result)   # it ended meanwhile
        return True


def _committed(done: Any, transport: Any, delivery_tag: str, consumer_node: str) -> None:
    """kazoo's thread: a slot's multi answered. Refused because the consumer's
    session ended, its message went back (at-least-once); lost with the
    connection, the plain ack's redo takes over (the slot, if made, goes at
    the task's end all the same)."""
    try:
        failure = multi_failure(done.get())
    except CONNECTION_ERRORS:
        transport.acks.ack_async(delivery_tag, consumer_node)
        return
    except Exception as exc:
        log_failure(logger, exc, "celery_zk: the slot of %s was not made", delivery_tag)
        return
    if failure is not None and failure[0] == 0:
        transport.acks.not_acked(delivery_tag, consumer_node)
    elif failure is not None:
        log_failure(logger, failure[1], "celery_zk: the slot of %s was not made",
                    delivery_tag)


def _release(client: Any, slot: str, made: Any) -> None:
    """Delete ``slot`` once its multi has answered (never blocks)."""
    def delete(_: Any) -> None:
        # NoNode: never made, or deleted by recovery, as it is with its consumer.
        try:
            unwaited(client.delete_async(slot), logger,
                     "celery_zk: the slot %s was not released", slot, expected=(NoNodeError,))
        except Exception as exc:
            log_failure(logger, exc, "celery_zk: the slot %s was not released", slot)
    made.rawlink(delete)


#: This process's slots: every pool of a worker, every consuming connection.
SLOTS = Slots()
