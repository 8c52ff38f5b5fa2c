"""Message bodies bigger than ``chunk_size``: chunks written before the message
is visible, a manifest in its body node, and orphans collected.

Nothing may lead to the chunks before the publish multi, which makes the
body and the name and marks the container *live*: so a reader never sees
half a message, and a container still *pending* after :data:`ORPHAN_AGE`
is an orphan that :func:`sweep` deletes. Assignments and requeues move the
name alone, never the chunks. See ``docs/design.md``, "Big messages".
"""
from __future__ import annotations

import logging
import time

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import NodeExistsError

from ..zk.client import answered, children, log_failure
from ..zk.layout import Layout
from ..zk.message_names import MessageName
from ..zk.payload import (
    delete_container,
    is_manifest,
    parse_manifest,
    read_payload,
    write_chunks,
)

__all__ = ["ORPHAN_AGE", "State", "mark", "parse_state", "prepare",
           "read_body", "stored", "sweep"]

logger = logging.getLogger(__name__)

#: Seconds after which a container no published message points at is an orphan
#: (a publish writes 16 MiB of chunks in well under a second).
ORPHAN_AGE = 600.0


class State:
    """What a container's data says: its state, then what it needs to know."""

    PENDING = b""            # chunks being written; no message yet
    LIVE = b"live "          # + "{bucket} {size}": where its message's body is
    DEAD = b"dead "          # + "{size}": its message is a dead letter (the dead
                             # node holds the manifest)


def parse_state(data: bytes) -> tuple[bytes, str, int]:
    """``(state, bucket, size)`` of a container's data (bucket "" unless live)."""
    for state in (State.LIVE, State.DEAD):
        if data.startswith(state):
            words = data[len(state):].decode().split()
            bucket = words[0] if state == State.LIVE and words else ""
            try:
                size = int(words[-1]) if words else 0
            except ValueError:
                size = 0
            return state, bucket, size
    return State.PENDING, "", 0


def prepare(client: KazooClient, layout: Layout, queue: str, uid: str, data: bytes,
            chunk_size: int) -> bytes:
    """Write ``data`` as the chunks of message ``uid``; the manifest for its body."""
    container = layout.chunk_container(queue, uid)
    try:
        client.retry(client.create, container, State.PENDING)
    except NodeExistsError:
        pass   # a retried create: ours already
    return write_chunks(client, container, data, chunk_size, ref=uid)


def mark(txn: TransactionRequest, layout: Layout, queue: str, uid: str,
         state: bytes, manifest: bytes, bucket: str = "") -> None:
    """Add the op that says what the container of ``uid`` belongs to: in the
    same multi that makes (or dead-letters) its message, so a container is
    pending exactly as long as no message points at it. ``manifest``: the
    message's, for its size (counted by ``celery zk status``)."""
    size = parse_manifest(manifest).size
    words = f"{bucket} {size}" if state == State.LIVE else f"{size}"
    txn.set_data(layout.chunk_container(queue, uid), state + words.encode())


def read_body(client: KazooClient, layout: Layout, queue: str, message: MessageName,
              data: bytes) -> bytes:
    """A message's body as read from its body node, made whole."""
    if not message.chunked or not is_manifest(data):
        return data
    return read_payload(client, layout.chunk_container(queue, message.uid), data)


def sweep(client: KazooClient, layout: Layout, queue: str, now: float | None = None) -> int:
    """Collect the orphans among ``queue``'s chunk containers; how many."""
    now = time.time() if now is None else now
    reads = [(name, client.get_async(layout.chunk_container(queue, name)))
             for name in children(client, layout.chunks(queue))]
    collected = 0
    for name, (data, stat) in answered(reads):
        state, bucket, _ = parse_state(data)
        if now - stat.ctime / 1000 < ORPHAN_AGE or state == State.DEAD:
            continue
        if state == State.LIVE:
            body = layout.listed(layout.body_bucket(queue, bucket), name)
            if client.retry(client.exists, body) is not None:
                continue   # its message waits or is owned
        try:
            delete_container(client, layout.chunk_container(queue, name))
        except Exception as exc:   # the next sweep tries again
            log_failure(logger, exc, "celery_zk: could not collect chunks/%s of %r",
                        name, queue)
            continue
        collected += 1
        logger.warning("celery_zk: collected the chunks of message %s of queue %r, which "
                       "no message points at (its publisher died while writing them?)",
                       name, queue)
    return collected


def stored(client: KazooClient, layout: Layout, queue: str) -> tuple[int, int]:
    """How many big messages ``queue`` stores (waiting, owned or dead), and
    their bytes, from their containers' data (a round trip; they are few)."""
    count = size = 0
    for _, (data, _) in answered([(name, client.get_async(layout.chunk_container(queue, name)))
                                  for name in children(client, layout.chunks(queue))]):
        state, _, bytes_ = parse_state(data)
        if state != State.PENDING:
            count, size = count + 1, size + bytes_
    return count, size
