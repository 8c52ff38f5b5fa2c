"""Dead letters for an operator: list, requeue and purge one queue's
(``celery zk dead ...``).

A requeue strips the reason line a dead node keeps before the message's bytes
(:mod:`celery_zk.broker.dead`) and creates the message where it waited (its
place among its priority), deleting the dead node in the same transaction. See
``docs/operations.md``, "Dead letters".
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kazoo.client import TransactionRequest
from kazoo.exceptions import NodeExistsError, NoNodeError

from ..broker import big
from ..broker.dead import UNKNOWN, unwrap
from ..broker.queues import Queues
from ..exceptions import CeleryZKError
from ..zk.client import children, multi_failure
from ..zk.message_names import bucket_name, parse_message_name, requeued_name
from ..zk.payload import delete_container, is_manifest, parse_manifest

__all__ = ["DeadLetter", "DeadLetters"]


@dataclass(frozen=True)
class DeadLetter:
    """One dead-lettered message, as ``celery zk dead list`` shows it."""

    id: str            # the dead node's name: what requeue and purge take
    reason: str
    at: float | None   # when it was dead-lettered (epoch seconds), if known
    host: str
    pid: int | None
    task: str          # Celery's task name, if the message is a Celery task
    task_id: str
    size: int          # bytes of the message itself

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class DeadLetters:
    """List, requeue and purge one queue's dead letters."""

    def __init__(self, queues: Queues, queue: str) -> None:
        self.queues = queues
        self.queue = queue
        self.client = queues.client
        self.layout = queues.layout

    def check_queue(self) -> None:
        if not self.queues.exists(self.queue):
            known = sorted(self.queues.queue_names())
            raise CeleryZKError(
                f"no queue {self.queue!r} under {self.layout.root!r}; queues there: "
                f"{', '.join(known) if known else 'none'}")

    def ids(self) -> list[str]:
        return sorted(children(self.client, self.layout.dead(self.queue)))

    def list(self) -> list[DeadLetter]:
        """Every dead letter, read in one pipelined round."""
        ids = self.ids()
        replies = [self.client.get_async(self._path(name)) for name in ids]
        letters = []
        for name, reply in zip(ids, replies):
            try:
                data, _ = reply.get()
            except NoNodeError:
                continue   # requeued or purged meanwhile
            letters.append(self._describe(name, data))
        return letters

    def requeue(self, name: str) -> str:
        """Put one dead letter back where it waited, in one transaction; its new name."""
        parsed = parse_message_name(name)
        if parsed is None:
            raise CeleryZKError(
                f"dead letter {name!r} of queue {self.queue!r} is not a message celery_zk "
                "wrote, so it cannot go back to the queue; look at it with "
                "`celery zk tree --data` and purge it with `celery zk dead purge`")
        source = self._path(name)
        try:
            data, stat = self.client.retry(self.client.get, source)
        except NoNodeError:
            raise CeleryZKError(f"no dead letter {name!r} in queue {self.queue!r}; "
                                "`celery zk dead list` shows them") from None
        _, message = unwrap(data)
        new_name = requeued_name(parsed)
        target = self.layout.unowned_message(self.queue, new_name)
        # An "n" message's body goes back to bodies/, its name to its bucket.
        body = self.layout.body(self.queue, parsed)
        missing = ([] if body is None else
                   [self.layout.bodies(self.queue), self.layout.parent(body)])
        missing.append(self.layout.parent(target))
        replies = [self.client.exists_async(path) for path in missing]
        missing = [path for path, reply in zip(missing, replies) if reply.get() is None]

        def build(txn: TransactionRequest) -> None:
            txn.delete(source, version=stat.version)
            for directory in missing:   # emptied and deleted since: made where it belongs
                txn.create(directory)
            if body is not None:
                txn.create(body, message)
            if parsed.chunked:   # its chunks stayed where they were: live again
                big.mark(txn, self.layout, self.queue, parsed.uid, big.State.LIVE, message,
                         bucket_name(parsed.inverted_priority, parsed.generation or 0))
            txn.create(target, b"" if body is not None else message)

        failure = multi_failure(self.queues.commit(build))
        if failure is not None:
            if isinstance(failure[1], (NoNodeError, NodeExistsError)) and \
                    self.client.exists(source) is None:
                return new_name   # a retry after it committed, or someone else moved it
            raise CeleryZKError(f"could not requeue dead letter {name!r}: "
                                f"{type(failure[1]).__name__}; nothing was changed")
        return new_name

    def purge(self) -> int:
        """Delete every dead letter (a big one's chunks too); how many this call deleted."""
        names = self.ids()
        removed = self.queues.delete_all([self._path(name) for name in names])
        for name in names:
            parsed = parse_message_name(name)
            if parsed is not None and parsed.chunked:
                delete_container(self.client,
                                 self.layout.chunk_container(self.queue, parsed.uid))
        return removed

    def _path(self, name: str) -> str:
        return self.layout.dead_message(self.queue, name)

    @staticmethod
    def _describe(name: str, data: bytes) -> DeadLetter:
        header, message = unwrap(data)
        task = task_id = ""
        size = len(message)
        if is_manifest(message):   # a big message: its chunks are not read to list it
            size = parse_manifest(message).size
        try:
            headers = json.loads(message).get("headers") or {}
            task, task_id = str(headers.get("task") or ""), str(headers.get("id") or "")
        except (ValueError, AttributeError):
            pass
        pid = header.get("pid")
        return DeadLetter(id=name, reason=str(header.get("reason") or UNKNOWN),
                          at=header.get("at"), host=str(header.get("host") or ""),
                          pid=pid if isinstance(pid, int) else None,
                          task=task, task_id=task_id, size=size)
