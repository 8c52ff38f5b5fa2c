"""Every node name celery_zk writes and parses but a message's
(:mod:`celery_zk.zk.message_names`): consumers, offers, holdings, bindings,
results, payloads, chords, and the escaping that makes any kombu name one
znode name.

Where each name lives is built in :mod:`celery_zk.zk.layout`; the tree is
drawn in ``docs/design.md``.
"""
from __future__ import annotations

import functools
import hashlib
import re
import time
import uuid
from typing import NamedTuple

OWNER_SEP = "~"
BINDING_SEP = ","
RESULT_SHARDS_HEX = 2  # 256 shards: a million results is ~4,000 per directory
CHORD_SIZE = OWNER_SEP + "size"   # beside a chord's counted parts, which are escaped ids
CHORD_DONE = OWNER_SEP + "done"
CHORD_ADDED = OWNER_SEP + "added"
CHORD_LAZY = OWNER_SEP + "lazy"
CHORD_SENT = OWNER_SEP + "sent"
#: The message property that asks a zk:// transport to make a node in the
#: multi that publishes the message, and to publish nothing if it exists:
#: ``{"hosts": ..., "username": ..., "path": ...}`` (a chord's body is sent once).
ONCE_PROPERTY = "celery_zk_once"
#: A chunk node's name: its index, zero-padded so a listing sorts in order
#: (a payload of max_result_size / chunk_size chunks; at most 10**6).
CHUNK_NAME = "c{index:06d}"
MAX_CHUNKS = 10 ** 6
PAYLOAD_ENTRY = "p" + OWNER_SEP   # an expiry index entry naming a payload container
REVOKED_TASK, REVOKED_STAMP = "t" + OWNER_SEP, "s" + OWNER_SEP   # kinds under revoked/
EXPIRY_CLEANER = OWNER_SEP + "cleaner"   # under expiry/, beside its hours (h...)
QUEUES_EXPIRER = "queues" + OWNER_SEP + "expirer"   # beside queues/ (escaped names)
#: ZooKeeper's own quota nodes for a path P: ``{QUOTA_ROOT}{P}/{QUOTA_LIMITS}``
#: (what an operator or celery_zk set) and ``.../{QUOTA_STATS}`` (the count of
#: nodes and bytes under P, kept by every server in memory).
QUOTA_ROOT = "/zookeeper/quota"
QUOTA_LIMITS, QUOTA_STATS = "zookeeper_limits", "zookeeper_stats"
# The sequential "-{seq}" suffix is from before consumer ids carried their time.
_CONSUMER_RE = re.compile(r"^(c[0-9a-f]{1,32})(?:-\d{10})?$")
_PAYLOAD_RE = re.compile(r"^([a-z])~([^/~]+)~([0-9a-f]{1,32})~(\d{1,12})$")
_HOLDING_RE = re.compile(r"^([^/~]+)~([0-9a-f]{1,32})-(\d{1,10})$")
_OFFER_RE = re.compile(r"^(c[0-9a-f]{1,32})~([0-9a-f]{1,32}(?:~b)?)$")
#: An offer's token ends so when its consumer takes a body from a handed name
#: (every consumer from 0.3 on, which reads the names its watch reports).
OFFER_TAKES_BODY = OWNER_SEP + "b"
# Characters that cannot appear raw in a node name, or that we use as separators.
_ESCAPE_RE = re.compile(r"[%/,~\x00-\x1f\x7f]")
AFFINITY_SHARDS_HEX = 1   # 16 directories under affinity/


@functools.lru_cache(maxsize=4096)
def escape(name: str) -> str:
    """Make a queue/exchange/routing-key string safe as one znode name (cached:
    every path of a message is built from its queue's name, a few per message)."""
    escaped = _ESCAPE_RE.sub(lambda m: f"%{ord(m.group()):02X}", name)
    if escaped in ("", ".", "..", "zookeeper"):
        escaped = "%" + escaped.encode().hex() + "%"  # reserved names stay distinct
    return escaped



@functools.lru_cache(maxsize=4096)
def unescape(name: str) -> str:
    if name.startswith("%") and name.endswith("%") and len(name) > 1 and "%" not in name[1:-1]:
        return bytes.fromhex(name[1:-1]).decode()
    return re.sub(r"%([0-9A-F]{2})", lambda m: chr(int(m.group(1), 16)), name)



def offer_name(consumer_id: str, token: str) -> str:
    return f"{consumer_id}{OWNER_SEP}{token}"



@functools.lru_cache(maxsize=1024)
def parse_offer_name(name: str) -> tuple[str, str] | None:
    """``(consumer id, token)`` of an offer node's name, or ``None`` if foreign."""
    match = _OFFER_RE.match(name)
    return (match.group(1), match.group(2)) if match else None



def holding_name(token: str, worker: str, pid: int) -> str:
    """A worker process's affinity holding: key token, worker id, pid."""
    return f"{token}{OWNER_SEP}{worker}-{pid}"



def parse_holding_name(name: str) -> tuple[str, str, int] | None:
    """``(key token, worker id, pid)`` of a holding node, or ``None`` if foreign."""
    match = _HOLDING_RE.match(name)
    return (match.group(1), match.group(2), int(match.group(3))) if match else None



def new_consumer_id() -> str:
    """A consumer id that sorts by creation time: its node needs no sequence
    number (whose counter would run out), and the oldest live one leads."""
    return f"c{time.time_ns():016x}{uuid.uuid4().hex[:8]}"



def parse_consumer_name(name: str) -> str | None:
    """The consumer id of a live-consumer node, or ``None`` if foreign."""
    match = _CONSUMER_RE.match(name)
    return match.group(1) if match else None



def queue_consumer_prefix(consumer_id: str) -> str:
    """The name of a queue's consumer node before ZooKeeper appends its sequence:
    the first to join leads (a newcomer never takes over from a live one)."""
    return f"{consumer_id}-"



def parse_queue_consumer(name: str) -> tuple[int, str] | None:
    """``(sequence, consumer id)`` of a queue's consumer node, or ``None``."""
    consumer_id, _, seq = name.rpartition("-")
    if not seq.isdigit() or parse_consumer_name(consumer_id) != consumer_id:
        return None
    return int(seq), consumer_id



def holder_name(session_id: int, lease: str) -> str:
    """An auto-delete queue's holder: named by the session, whose end removes it,
    and by the lease (one connection) on it, whose end deletes it."""
    return f"s{session_id:016x}-{lease}"



def binding_name(queue: str, routing_key: str) -> str:
    return f"{escape(queue)}{BINDING_SEP}{escape(routing_key)}"



def parse_binding_name(name: str) -> tuple[str, str] | None:
    queue, sep, routing_key = name.partition(BINDING_SEP)
    if not sep:
        return None
    return unescape(queue), unescape(routing_key)



def result_shard(key: str) -> str:
    return hashlib.sha1(key.encode()).hexdigest()[:RESULT_SHARDS_HEX]



def chunk_name(index: int) -> str:
    """The name of a payload's chunk ``index`` (celery_zk.zk.payload)."""
    if not 0 <= index < MAX_CHUNKS:
        raise ValueError(f"chunk index {index} is out of range (0 to {MAX_CHUNKS - 1})")
    return CHUNK_NAME.format(index=index)



class PayloadName(NamedTuple):
    """What a payload container's name says: whose it is, which write, how big."""

    kind: str      # the kind of node it belongs to (an expiry kind: r, g)
    id: str        # that node's id (a task or group id)
    token: str     # one per write: a rewrite never mixes its chunks with older ones
    size: int      # the payload's bytes (status sums them without reading anything)



def payload_name(kind: str, key: str, token: str, size: int) -> str:
    """``{kind}~{escaped id}~{token}~{size}``: a payload container's name."""
    return f"{kind}{OWNER_SEP}{escape(key)}{OWNER_SEP}{token}{OWNER_SEP}{size}"



def parse_payload_name(name: str) -> PayloadName | None:
    match = _PAYLOAD_RE.match(name)
    if not match:
        return None
    kind, key, token, size = match.groups()
    return PayloadName(kind, unescape(key), token, int(size))
