"""Znode layout: every path and node name celery_zk uses is built here.

::

    {root}/
      queues/{queue}/                 data: queue meta (JSON)
        unowned/p{P}-{gen}/           a bucket: waiting messages of one priority,
                                      at most ``bucket_size`` sequential creates each
          n{P}-{gen}-{uid}-{seq}      a waiting message's name (empty); P = 9 - priority
          n{P}-{gen}-{uid}-r{first}   requeued message, keeps its first seq
          n{P}-{gen}-{uid}@{key}-{seq}  one with a data-affinity key (celery_zk.features.affinity)
        bodies/p{P}-{gen}/{uid}       an ``n`` message's body, written once by its publisher
                                      and deleted by its ack: only names move; a ``c``
                                      message's holds the manifest of its chunks
        chunks/{uid}/c{index:06d}     the chunks of a message bigger than chunk_size;
                                      data of chunks/{uid}: its state (celery_zk.broker.big)
        consumers/{consumer}-{seq}    ephemeral, sequential: a connection consumes this
                                      queue; data: {"credit", "worker", "host", "pid"};
                                      the first (lowest seq) one's process dispatches
                                      (celery_zk.broker.dispatcher)
        owned/{consumer}/             the consumer's inbox: what it was given
          {unowned name}              given by the dispatcher, or handed over by a
                                      publisher (celery_zk.broker.handoff)
        offers/{consumer}~{token}     ephemeral: a consumer with a free pool slot offers
                                      to take messages (broker.handoff)
        dead/{unowned name}           dead-lettered (rejected / undecodable); data: a
                                      reason line, then the message (celery_zk.broker.dead)
        holders/s{session}-{lease}    auto-delete queues only: ephemeral, one per
                                      connection that declared it; none left = deleted
      exchanges/{exchange}/           data: {"type": ...}
        bindings/{queue},{routing key}    ephemeral for auto-delete queues
      consumers/{consumer}            ephemeral: one per live consuming connection;
                                      the id starts with its creation time in ns;
                                      data: {"host", "pid", "queues"}
      results/{shard}/{task id}       done node: the task's result meta, or the
                                      manifest of its chunks (celery_zk.zk.payload)
      groups/{shard}/{group id}       saved GroupResult
      chords/{group id}               chord counter (children are completed parts)
        {task id}                     one per counted header task: counts it once;
                                      data: "{count}:{token}:{group index}"
        ~size                         how many parts it waits for (Celery's set_chord_size)
        ~added                        how many Task.add_to_chord added since
        ~lazy                         the header was a generator: no saved group
        ~done                         the body was sent: parts deleted, counter kept
                                      until expiry or the chord's next apply
      payloads/{shard}/{kind}~{id}~{token}~{size}   the chunks of one write of a result
        c{index:06d}                  (kind r) or saved group (g) above chunk_size:
                                      one container per write (celery_zk.backend.payloads)
      expiry/h{hour}/{shard}/{kind}~{id}  index of results/groups/chords by write hour
      expiry/h{hour}/{shard}/p~{payload name}  index of the payload containers made in
                                      that hour (written before their chunks)
      locks/{key}                     ephemeral: a running singleton task's lock
                                      (celery_zk.features.singleton); czxid: fencing token
      revoked/{shard}/t~{task id}     a revoke kept for workers started later; data:
      revoked/{shard}/s~{hash}        when (and the stamp) (celery_zk.features.revokes)
      affinity/{h}/{key}~{worker}-{pid}   ephemeral: a worker process holds the data
                                      of {key} (celery_zk.features.affinity); h: one
                                      hex digit of its hash

Names carry what a reader needs, so a consumer orders a queue from
``get_children`` alone: priority first (inverted so a plain sort puts the
highest first), then the bucket's generation, then the first sequence number
ZooKeeper gave the message, so a requeued message keeps its original place
among its priority. The uid lets a create retried after ConnectionLoss find
the node it already made.

Buckets keep every directory small and every sequence counter far from its
end (a signed 32-bit count of creates per parent): a publisher moves on to
generation ``gen + 1`` once a create's sequence reaches ``bucket_size``, and
a consumer deletes an empty bucket once a later one of its priority exists.
A requeue is not sequential (the uid makes its name unique), so it never
advances a counter either.

Messages stored by celery_zk before 0.2 (an ``m`` name with its body inside,
flat in ``unowned/`` or in a bucket, or claimed as ``owned/{consumer}~{name}``)
are read by nothing but ``celery zk upgrade`` (:mod:`celery_zk.ops.upgrade`),
which stores them as every other message is; :func:`is_legacy` tells them apart.
"""
from __future__ import annotations

import functools
import hashlib
import re
import time
import uuid
from dataclasses import dataclass
from typing import NamedTuple

from kazoo.protocol.paths import join

MAX_PRIORITY = 9
SEQ_DIGITS = 10
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

#: The first letter of a message name: how its body is stored in bodies/.
BODY_APART = "n"    # whole, written once; the name alone moves
BODY_CHUNKED = "c"  # as "n", and bigger than chunk_size: its body node holds a
                    # manifest, the bytes are chunks under chunks/{uid}
_MESSAGE_RE = re.compile(
    r"^([nc])(\d)-(\d{10})-([0-9a-f]{1,32})(?:\.([0-9a-f]{8}))?(?:!([0-9a-f]{8}))?"
    r"(?:@([^/~]+?))?-(r?)(\d{10})$")
#: Names celery_zk stored before 0.2, the body inside the node: in a bucket as
#: today's but for their "m", or flat in unowned/ (the requeue sequential too).
_LEGACY_FLAT_RE = re.compile(r"^m(\d)-([0-9a-f]{1,32})-(?:r(\d{10})-)?(\d{10})$")
_BUCKET_RE = re.compile(r"^p(\d)-(\d{10})$")
# The sequential "-{seq}" suffix is from before consumer ids carried their time.
_CONSUMER_RE = re.compile(r"^(c[0-9a-f]{1,32})(?:-\d{10})?$")
_PAYLOAD_RE = re.compile(r"^([a-z])~([^/~]+)~([0-9a-f]{1,32})~(\d{1,12})$")
_HOLDING_RE = re.compile(r"^([^/~]+)~([0-9a-f]{1,32})-(\d{1,10})$")
# An offer's token of a release before 0.4 may end in "~b".
_OFFER_RE = re.compile(r"^(c[0-9a-f]{1,32})~([0-9a-f]{1,32}(?:~b)?)$")
# Characters that cannot appear raw in a node name, or that we use as separators.
_ESCAPE_RE = re.compile(r"[%/,~\x00-\x1f\x7f]")
#: Longest affinity key kept readable in a message name; a longer one is named
#: by its hash. A bucket is listed whole (up to 10,000 names), and the listing
#: must stay within jute.maxbuffer: (45 + 1 + 40) bytes x 10,000 = 860 KB.
AFFINITY_KEY_CHARS = 40
AFFINITY_HASH = "#"
#: Characters an affinity key keeps as they are: printable ASCII but the
#: escape, the separators and the markers of a hash and of a key.
_AFFINITY_PLAIN = frozenset(map(chr, range(0x20, 0x7F))) - set("%/,~#@")
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


class MessageName(NamedTuple):
    """A parsed waiting-message name."""

    inverted_priority: int
    generation: int     # its bucket's
    uid: str
    order: int          # the sequence it was first published with
    requeued: bool      # back from owned/ (a reject, a shutdown or a dead owner)
    seq: int            # this node's own sequence (a requeue's is its order)
    affinity: str | None = None   # its affinity key as named (affinity_token)
    chunked: bool = False      # its body is chunked (a "c" name): see Layout.chunks
    task: str | None = None    # its task's token (task_token), for limits
    limit_key: str | None = None   # its concurrency key's token (limit_key_token)

    @property
    def kind(self) -> str:
        """The letter its name starts with."""
        return BODY_CHUNKED if self.chunked else BODY_APART

    @property
    def priority(self) -> int:
        return MAX_PRIORITY - self.inverted_priority

    @property
    def bucket(self) -> str:
        return bucket_name(self.inverted_priority, self.generation)

    @property
    def sort_key(self) -> tuple[int, int, int, bool, int]:
        # On equal order a requeued message goes first: the tie is a handed
        # message (order 0, see handed_name) against a bucket's very first one.
        return (self.inverted_priority, self.generation, self.order, not self.requeued,
                self.seq)


def clamp_priority(priority: int | None) -> int:
    """AMQP semantics: higher first, 0..9, missing counts as 0."""
    if priority is None:
        return 0
    return max(0, min(MAX_PRIORITY, int(priority)))


def inverted(priority: int | None) -> int:
    return MAX_PRIORITY - clamp_priority(priority)


@functools.lru_cache(maxsize=1 << 12)
def bucket_name(inverted_priority: int, generation: int) -> str:
    # Cached: a message's bucket is named wherever its body's path is built.
    return f"p{inverted_priority}-{generation:0{SEQ_DIGITS}d}"


def parse_bucket_name(name: str) -> tuple[int, int] | None:
    """``(inverted priority, generation)`` of a bucket, or ``None``."""
    match = _BUCKET_RE.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def same_priority(bucket: str, other: str) -> bool:
    """Two bucket names of one priority (the later one takes its new messages)."""
    first, second = parse_bucket_name(bucket), parse_bucket_name(other)
    return first is not None and second is not None and first[0] == second[0]


def message_prefix(inverted_priority: int, generation: int, uid: str,
                   affinity: str | None = None, kind: str = BODY_APART,
                   task: str | None = None, limit_key: str | None = None) -> str:
    """Name prefix of a new message; ZooKeeper appends the sequence.
    ``affinity``: an :func:`affinity_token`. ``kind``: where the body is
    (:data:`BODY_APART` or :data:`BODY_CHUNKED`).
    ``task``/``limit_key``: a :func:`task_token` and a :func:`limit_key_token`,
    which a dispatcher applies limits by (celery_zk.features.limits)."""
    tokens = (f".{task}" if task else "") + (f"!{limit_key}" if limit_key else "")
    key = f"@{affinity}" if affinity else ""
    return f"{kind}{inverted_priority}-{generation:0{SEQ_DIGITS}d}-{uid}{tokens}{key}-"


@functools.lru_cache(maxsize=1024)
def task_token(task_name: str) -> str:
    """How a task's name appears in its messages' names: 8 hex digits of a hash
    (names must stay short; limits are looked up by it)."""
    return hashlib.sha1(task_name.encode()).hexdigest()[:8]


def limit_key_token(key: str) -> str:
    """How a concurrency limit's key (one customer id, say) appears in names."""
    return hashlib.sha1(key.encode()).hexdigest()[:8]


def affinity_token(key: object) -> str:
    """How an affinity key appears in node names: printable ASCII, the rest
    %-escaped (``#`` too, which marks a hash), or ``#`` and a hash when that is
    longer than :data:`AFFINITY_KEY_CHARS` bytes.

    Raises ValueError for what cannot be a key (not a str or int, or empty).
    """
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise ValueError(
            f"a celery_zk affinity key must be a string (or an int), not "
            f"{type(key).__name__} {key!r}: pass the dataset's name, e.g. "
            "headers={'zk_affinity': 'dataset-42'}")
    text = str(key)
    if not text:
        raise ValueError("a celery_zk affinity key must not be empty: leave the "
                         "'zk_affinity' header out for a message without affinity")
    # Anything but printable ASCII goes in as the %-escaped bytes of its UTF-8:
    # ZooKeeper refuses some code points in names (U+0080-U+009F, surrogates,
    # U+F000-U+F8FF, U+FFF0-U+FFFF), and the length limit is then one of bytes.
    # (A byte below 0x80 is its ASCII character; every byte of a longer
    # sequence is 0x80 or above, so escaped.)
    raw = text.encode("utf-8", "surrogatepass")
    escaped = "".join(chr(byte) if chr(byte) in _AFFINITY_PLAIN else f"%{byte:02X}"
                      for byte in raw)
    if len(escaped) <= AFFINITY_KEY_CHARS:
        return escaped
    return AFFINITY_HASH + hashlib.sha1(raw).hexdigest()[:24]


def requeued_name(message: MessageName) -> str:
    """The name a message gets when it goes back to wait: in the bucket of its
    first publication, marked requeued, with the sequence that keeps its place."""
    return (message_prefix(message.inverted_priority, message.generation, message.uid,
                           message.affinity, message.kind, message.task, message.limit_key)
            + f"r{message.order:0{SEQ_DIGITS}d}")


@functools.lru_cache(maxsize=1 << 14)
def parse_message_name(name: str) -> MessageName | None:
    """Parse a waiting-message name; ``None`` for nodes celery_zk did not write.
    Cached: a message's name is parsed where it is listed, sorted, given,
    read, delivered and acked, a dozen times between publish and ack; the
    result is immutable. The cache holds about a listing's worth (~4 MB)."""
    match = _MESSAGE_RE.match(name)
    if not match:
        return None
    kind, inv, generation, uid, task, limit, affinity, requeued, seq = match.groups()
    return MessageName(int(inv), int(generation), uid, int(seq), bool(requeued), int(seq),
                       affinity, kind == BODY_CHUNKED, task, limit)


def parse_legacy_name(name: str) -> MessageName | None:
    """A message name stored before 0.2 (see the module docstring; claimed
    ones without their ``{consumer}~``), parsed as the message it becomes
    once upgraded: its body in bodies/, a flat one in bucket 0."""
    if not name.startswith("m"):
        return None
    message = parse_message_name("n" + name[1:])
    if message is not None:
        return message
    match = _LEGACY_FLAT_RE.match(name)
    if not match:
        return None
    inv, uid, first, seq = match.groups()
    return MessageName(int(inv), 0, uid, int(first or seq), first is not None, int(seq))


def is_legacy(name: str) -> bool:
    """Whether ``name`` (as listed in unowned/ or owned/) is a message stored before 0.2."""
    return parse_legacy_name(name.rpartition(OWNER_SEP)[2]) is not None


#: A message's place in delivery order: its sort key, then its name (ties).
OrderKey = tuple[tuple[int, int, int, bool, int], str]


@functools.lru_cache(maxsize=1 << 14)
def order_key(name: str) -> OrderKey | None:
    """``(sort_key, name)`` of a message name; ``None`` for nodes celery_zk did not
    write. Cached like the parse: a dispatcher orders a bucket's thousands of
    names at each listing, then looks each one up again as it is given."""
    message = parse_message_name(name)
    return None if message is None else (message.sort_key, name)


def sort_messages(names: list[str]) -> tuple[list[str], list[str]]:
    """Split a listing into (ours in delivery order, foreign names)."""
    keyed: list[OrderKey] = []
    foreign = []
    for name in names:
        key = order_key(name)
        if key is None:
            foreign.append(name)
        else:
            keyed.append(key)
    keyed.sort()
    return [name for _, name in keyed], foreign


@functools.lru_cache(maxsize=1 << 12)
def _queue_dir(root: str, queue: str, *below: str) -> str:
    """``{root}/queues/{escaped queue}[/below...]``: cached, since a message's
    paths (its body, its inbox entry, its bucket) are built a few times per
    delivery from these few directories (9% of a prefork parent's Python time
    before it was, in a drain; benchmarks/README.md)."""
    return join(root, "queues", escape(queue), *below)


@functools.lru_cache(maxsize=1 << 14)
def _split_owned_path(queues: str, path: str) -> tuple[str, str, str]:
    """:meth:`Layout.split_owned_path` under ``queues``; cached: a delivery tag is
    split where it is acked, settled and where its task starts."""
    head, _, name = path.rpartition("/")
    parent, _, owner = head.rpartition("/")
    if (owner and parent.endswith("/owned") and parse_message_name(name) is not None
            and parse_consumer_name(owner) == owner):
        queue_path = parent[:-len("/owned")]
        if queue_path.startswith(queues + "/"):
            return unescape(queue_path[len(queues) + 1:]), owner, name
    raise ValueError(f"not an owned-message path: {path!r}")


def handed_name(inverted_priority: int, generation: int, uid: str,
                kind: str = BODY_APART, task: str | None = None,
                limit_key: str | None = None) -> str:
    """The name a message handed straight to an idle consumer gets.

    It never waited in a bucket, so it has no sequence: zero. Its body is in
    the bucket of ``generation`` like any other's, and a requeue puts it at
    the front of that bucket: it was handed over while the queue was empty,
    ahead of its priority's later arrivals, where it belongs.
    """
    return (message_prefix(inverted_priority, generation, uid, kind=kind, task=task,
                           limit_key=limit_key) + "0" * SEQ_DIGITS)


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


def quick_affinity(name: str) -> str | None:
    """The affinity token of a message name known to be ours (a sorted
    listing's), without a full parse: a consumer looks at a thousand names
    per choice. The token runs from the ``@`` after the uid to the ``-``
    before the sequence, which has none."""
    at = name.find("@")
    return None if at < 0 else name[at + 1:name.rindex("-")]


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


#: Every name result_shard() can return.
ALL_SHARDS = tuple(f"{i:0{RESULT_SHARDS_HEX}x}" for i in range(16 ** RESULT_SHARDS_HEX))


@dataclass(frozen=True)
class Layout:
    """Paths under one root (the URL's path)."""

    root: str

    @staticmethod
    def parent(path: str) -> str:
        """The directory a path built here lives in (to create it on demand)."""
        return path.rpartition("/")[0] or "/"

    @staticmethod
    def shards(sharded: str) -> list[str]:
        """Every shard directory of a sharded level: results/, groups/ or an expiry bucket."""
        return [join(sharded, shard) for shard in ALL_SHARDS]

    # -- queues ---------------------------------------------------------------
    @property
    def queues(self) -> str:
        return join(self.root, "queues")

    def queue(self, queue: str) -> str:
        return _queue_dir(self.root, queue)

    def unowned(self, queue: str) -> str:
        return _queue_dir(self.root, queue, "unowned")

    def owned(self, queue: str) -> str:
        return _queue_dir(self.root, queue, "owned")

    def dead(self, queue: str) -> str:
        return join(self.queue(queue), "dead")

    def offers(self, queue: str) -> str:
        return join(self.queue(queue), "offers")

    def offer(self, queue: str, name: str) -> str:
        return join(self.offers(queue), name)

    def holders(self, queue: str) -> str:
        """Exists only for auto-delete queues: the sessions that declared it."""
        return join(self.queue(queue), "holders")

    def holder(self, queue: str, session_id: int, lease: str) -> str:
        return join(self.holders(queue), holder_name(session_id, lease))

    def queue_directories(self, queue: str) -> tuple[str, ...]:
        """The directories every queue has."""
        return (self.unowned(queue), self.bodies(queue), self.owned(queue), self.dead(queue),
                self.offers(queue), self.queue_consumers(queue), self.chunks(queue))

    def bucket(self, queue: str, name: str) -> str:
        """A bucket of ``unowned/`` by its name (see :func:`bucket_name`)."""
        return _queue_dir(self.root, queue, "unowned", name)

    def unowned_message(self, queue: str, name: str) -> str:
        """Where a waiting message lives: in the bucket its name states (a
        foreign name, as listed: ``bucket/name``, or directly in ``unowned/``)."""
        message = parse_message_name(name)
        if message is None:
            return f"{self.unowned(queue)}/{name}"
        return f"{self.bucket(queue, message.bucket)}/{name}"

    def new_message_prefix(self, queue: str, inverted_priority: int, generation: int,
                           uid: str, affinity: str | None = None,
                           kind: str = BODY_APART, task: str | None = None,
                           limit_key: str | None = None) -> str:
        """The path a new message is created at (ZooKeeper appends the sequence)."""
        return join(self.bucket(queue, bucket_name(inverted_priority, generation)),
                    message_prefix(inverted_priority, generation, uid, affinity, kind, task,
                                   limit_key))

    # -- bodies: written once, deleted by the ack ------------------------------
    def bodies(self, queue: str) -> str:
        return _queue_dir(self.root, queue, "bodies")

    def body_bucket(self, queue: str, bucket: str) -> str:
        """Where the bodies of a bucket's messages live (the bucket's twin)."""
        return _queue_dir(self.root, queue, "bodies", bucket)

    def body(self, queue: str, message: MessageName) -> str:
        """Where a message's body lives."""
        return f"{self.body_bucket(queue, message.bucket)}/{message.uid}"

    def new_body(self, queue: str, inverted_priority: int, generation: int, uid: str) -> str:
        return join(self.body_bucket(queue, bucket_name(inverted_priority, generation)), uid)

    def chunks(self, queue: str) -> str:
        """The chunk containers of the queue's big message bodies (``c`` names):
        few, since they hold only messages bigger than chunk_size."""
        return join(self.queue(queue), "chunks")

    def chunk_container(self, queue: str, uid: str) -> str:
        """Where the chunks of message ``uid``'s body are. Named by the uid alone:
        a publish may move to another bucket after its chunks were written."""
        return join(self.chunks(queue), uid)

    # -- consumers of a queue and their inboxes ------------------------------
    def queue_consumers(self, queue: str) -> str:
        """Ephemeral nodes of the connections consuming ``queue``; the oldest
        one's process dispatches the queue (celery_zk.broker.dispatcher)."""
        return join(self.queue(queue), "consumers")

    def queue_consumer(self, queue: str, name: str) -> str:
        """A node under the queue's consumers/ by its name as listed."""
        return join(self.queue_consumers(queue), name)

    def new_queue_consumer(self, queue: str, consumer_id: str) -> str:
        """Where a consumer registers on a queue (a sequential create)."""
        return join(self.queue_consumers(queue), queue_consumer_prefix(consumer_id))

    def inbox(self, queue: str, consumer_id: str) -> str:
        """A consumer's inbox: ``owned/{consumer}/``; only what is given to it
        lands there, and only it deletes from it (acks)."""
        return _queue_dir(self.root, queue, "owned", consumer_id)

    def inbox_message(self, queue: str, consumer_id: str, name: str) -> str:
        return f"{self.inbox(queue, consumer_id)}/{name}"

    def dead_message(self, queue: str, name: str) -> str:
        """``name``: a waiting message's, or a foreign node's path under ``unowned/``
        (``bucket/name``), kept as one name."""
        return join(self.dead(queue), name.replace("/", OWNER_SEP))

    def split_owned_path(self, path: str) -> tuple[str, str, str]:
        """``(queue, consumer id, unowned name)`` of an owned message in an
        inbox (``owned/{consumer}/{name}``)."""
        return _split_owned_path(self.queues, path)

    # -- routing --------------------------------------------------------------
    @property
    def exchanges(self) -> str:
        return join(self.root, "exchanges")

    def exchange(self, exchange: str) -> str:
        return join(self.exchanges, escape(exchange))

    def bindings(self, exchange: str) -> str:
        return join(self.exchange(exchange), "bindings")

    def binding(self, exchange: str, queue: str, routing_key: str) -> str:
        return join(self.bindings(exchange), binding_name(queue, routing_key))

    # -- liveness -------------------------------------------------------------
    @property
    def consumers(self) -> str:
        return join(self.root, "consumers")

    def consumer(self, consumer_id: str) -> str:
        return join(self.consumers, consumer_id)

    # -- results (the backend) ------------------------------------------------
    @property
    def results(self) -> str:
        return join(self.root, "results")

    def result(self, task_id: str) -> str:
        return join(self.results, result_shard(task_id), escape(task_id))

    @property
    def groups(self) -> str:
        return join(self.root, "groups")

    def group(self, group_id: str) -> str:
        return join(self.groups, result_shard(group_id), escape(group_id))

    @property
    def chords(self) -> str:
        return join(self.root, "chords")

    def chord(self, group_id: str) -> str:
        return join(self.chords, escape(group_id))

    def chord_part(self, group_id: str, task_id: str) -> str:
        return join(self.chord(group_id), escape(task_id))

    def chord_child(self, group_id: str, name: str) -> str:
        """A child of a chord counter by its name as listed (already escaped)."""
        return join(self.chord(group_id), name)

    def chord_size(self, group_id: str) -> str:
        """How many parts the chord waits for. ``~`` never starts an escaped task id."""
        return join(self.chord(group_id), CHORD_SIZE)

    def chord_done(self, group_id: str) -> str:
        """Made when the chord's body was sent: the counter is then a tombstone."""
        return join(self.chord(group_id), CHORD_DONE)

    def chord_added(self, group_id: str) -> str:
        """How many parts ``Task.add_to_chord`` added to the chord's size."""
        return join(self.chord(group_id), CHORD_ADDED)

    def chord_lazy(self, group_id: str) -> str:
        """Made when the header is a generator: the parts, not a saved group,
        say which results the body gets."""
        return join(self.chord(group_id), CHORD_LAZY)

    def chord_sent(self, group_id: str) -> str:
        """Made by the multi that publishes the chord's body (zk:// broker on the
        same ensemble): a body is never published twice in one run."""
        return join(self.chord(group_id), CHORD_SENT)

    # -- singleton locks (celery_zk.features.singleton) --------------------------------
    @property
    def locks(self) -> str:
        return join(self.root, "locks")

    def lock(self, key: str) -> str:
        """A singleton task's lock: ephemeral, of the session of the run holding it."""
        return join(self.locks, escape(key))

    # -- durable revokes (celery_zk.features.revokes) ----------------------------------
    @property
    def revoked(self) -> str:
        return join(self.root, "revoked")

    def revoked_task(self, task_id: str) -> str:
        """A revoked task id, sharded like results/ (Celery keeps up to 50,000)."""
        key = REVOKED_TASK + escape(task_id)
        return join(self.revoked, result_shard(key), key)

    def revoked_stamp(self, header: str, value: str) -> str:
        """A revoked stamp (revoke_by_stamped_headers): named by a hash of both,
        which may be any text; the node's data says which."""
        digest = hashlib.sha1(f"{header}\0{value}".encode()).hexdigest()
        key = REVOKED_STAMP + digest
        return join(self.revoked, result_shard(key), key)

    # -- cluster-wide limits (celery_zk.features.limits) -------------------------------
    @property
    def limits(self) -> str:
        return join(self.root, "limits")

    def limit(self, kind: str, name: str) -> str:
        """A limit on a task (``kind`` "t") or a queue ("q"); data: its settings."""
        return join(self.limits, f"{kind}{OWNER_SEP}{escape(name)}")

    def limit_given(self, kind: str, name: str) -> str:
        """When the last messages under a rate limit were given (a dispatcher
        that takes over goes on from there)."""
        return join(self.limit(kind, name), "given")

    def limit_started(self, kind: str, name: str) -> str:
        """When the last tasks under a rate limit started (the workers' record)."""
        return join(self.limit(kind, name), "started")

    @staticmethod
    def parse_limit_name(name: str) -> tuple[str, str] | None:
        kind, sep, escaped = name.partition(OWNER_SEP)
        return (kind, unescape(escaped)) if sep and kind in ("t", "q") else None

    # -- data affinity (celery_zk.features.affinity) ------------------------------------
    @property
    def affinity(self) -> str:
        return join(self.root, "affinity")

    def affinity_shards(self) -> list[str]:
        return [join(self.affinity, f"{i:0{AFFINITY_SHARDS_HEX}x}")
                for i in range(16 ** AFFINITY_SHARDS_HEX)]

    def holding(self, token: str, worker: str, pid: int) -> str:
        """Ephemeral: worker process ``worker``/``pid`` holds the data of ``token``."""
        shard = hashlib.sha1(token.encode()).hexdigest()[:AFFINITY_SHARDS_HEX]
        return join(self.affinity, shard, holding_name(token, worker, pid))

    # -- chunked payloads of results (celery_zk.backend.payloads) -----------------------
    @property
    def payloads(self) -> str:
        return join(self.root, "payloads")

    def payload(self, kind: str, key: str, token: str, size: int) -> str:
        """The container of one write's chunks, sharded like the node it belongs to."""
        return join(self.payloads, result_shard(key), payload_name(kind, key, token, size))

    def payload_in_shard(self, shard: str, name: str) -> str:
        """A container by its shard and name as listed."""
        return join(self.payloads, shard, name)

    @staticmethod
    def listed(directory: str, name: str) -> str:
        """A child of ``directory`` by its name as listed (already a node name)."""
        return join(directory, name)

    @staticmethod
    def chunk(container: str, index: int) -> str:
        """Chunk ``index`` of a payload stored under ``container`` (any directory)."""
        return join(container, chunk_name(index))

    def payload_entry(self, hour: int, kind: str, key: str, token: str, size: int) -> str:
        """Expiry index entry of a payload container made in ``hour``; in the shard
        of its node's own entries, so one cleanup round sees both."""
        return join(self.expiry_shard(hour, result_shard(key)),
                    PAYLOAD_ENTRY + payload_name(kind, key, token, size))

    @staticmethod
    def parse_payload_entry(name: str) -> PayloadName | None:
        if not name.startswith(PAYLOAD_ENTRY):
            return None
        return parse_payload_name(name[len(PAYLOAD_ENTRY):])

    @property
    def expiry(self) -> str:
        return join(self.root, "expiry")

    def expiry_bucket(self, hour: int) -> str:
        return join(self.expiry, f"h{hour:010d}")

    def expiry_shard(self, hour: int, shard: str) -> str:
        return join(self.expiry_bucket(hour), shard)

    def expiry_entry(self, hour: int, kind: str, key: str) -> str:
        """Index entry pointing at a results/, groups/ or chords/ node written in ``hour``.

        Sharded like results/: a busy hour would otherwise put more names in one
        directory than a single get_children reply can carry (jute.maxbuffer).
        """
        return join(self.expiry_shard(hour, result_shard(key)),
                    f"{kind}{OWNER_SEP}{escape(key)}")

    @staticmethod
    def parse_expiry_bucket(name: str) -> int | None:
        return int(name[1:]) if name.startswith("h") and name[1:].isdigit() else None

    @staticmethod
    def parse_expiry_entry(name: str) -> tuple[str, str] | None:
        kind, sep, key = name.partition(OWNER_SEP)
        return (kind, unescape(key)) if sep else None
