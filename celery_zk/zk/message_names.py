"""A waiting message's name: the grammar a dispatcher orders and chooses by.

A listing alone orders a queue and says what to choose by: priority
(inverted, so a plain sort puts 9 first), the bucket's generation, then the
first sequence, which a requeue keeps (its name is unique by the uid, so it
takes no sequence); then the affinity key, limit tokens and size. The uid
also lets a create retried after ConnectionLoss find its node. Names of
before 0.2 (``m``) are read by ``celery zk upgrade`` alone (:func:`is_legacy`);
every other name is in :mod:`celery_zk.zk.names`. See ``docs/design.md``,
"Names carry what a reader needs" and "Buckets".
"""
from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import re
import zlib
from typing import NamedTuple

from .names import OWNER_SEP

MAX_PRIORITY = 9
SEQ_DIGITS = 10
#: Before a message's name in its consumer's inbox: the concurrency slot of its
#: task, acked as it started and running still (celery_zk.broker.slots).
SLOT = OWNER_SEP
#: The first letter of a message name: how its body is stored in bodies/.
BODY_APART = "n"    # whole, written once; the name alone moves
BODY_CHUNKED = "c"  # as "n", and bigger than chunk_size: its body node holds a
                    # manifest, the bytes are chunks under chunks/{uid}
_MESSAGE_RE = re.compile(
    r"^([nc])(\d)-(\d{10})-([0-9a-f]{1,32})(?:\.([0-9a-f]{8}))?(?:!([0-9a-f]{8}))?"
    r"(?:\+(\d{1,12}))?(?:@([^/~]+?))?-(r?)(\d{10})$")
#: Names celery_zk stored before 0.2, the body inside the node: in a bucket as
#: today's but for their "m", or flat in unowned/ (the requeue sequential too).
_LEGACY_FLAT_RE = re.compile(r"^m(\d)-([0-9a-f]{1,32})-(?:r(\d{10})-)?(\d{10})$")
_BUCKET_RE = re.compile(r"^p(\d)-(\d{10})$")
#: A handed message's name may carry a copy of its body, ``{name}~{body}``:
#: zlib, then unpadded base64url (no "/", no "~", nothing to escape).
INLINE_SEP = OWNER_SEP
_INLINE_RE = re.compile(r"[A-Za-z0-9_-]+")
#: Most characters of a body copied into a handed name. A Celery task's body
#: is a few hundred; the watch event that names the entry brings it, so its
#: delivery needs no read (one-way p50 idle 1.14, loaded 1.21 times as long
#: without: docs/performance.md). Far below jute.maxbuffer.
INLINE_CHARS = 2048
#: Longest affinity key kept readable in a message name; a longer one is named
#: by its hash. A bucket is listed whole (up to 10,000 names), and the listing
#: must stay within jute.maxbuffer: (45 + 1 + 40) bytes x 10,000 = 860 KB.
AFFINITY_KEY_CHARS = 40
AFFINITY_HASH = "#"
#: Characters an affinity key keeps as they are: printable ASCII but the
#: escape, the separators and the markers of a hash and of a key.
_AFFINITY_PLAIN = frozenset(map(chr, range(0x20, 0x7F))) - set("%/,~#@")


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
    size: int | None = None   # its body's bytes, named in a queue with x-max-length-bytes

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
                   task: str | None = None, limit_key: str | None = None,
                   size: int | None = None) -> str:
    """Name prefix of a new message; ZooKeeper appends the sequence.
    ``affinity``: an :func:`affinity_token`. ``kind``: where the body is
    (:data:`BODY_APART` or :data:`BODY_CHUNKED`).
    ``task``/``limit_key``: a :func:`task_token` and a :func:`limit_key_token`,
    which a dispatcher applies limits by (celery_zk.features.limits).
    ``size``: the body's bytes, in a queue whose ``x-max-length-bytes`` is
    counted from its listing (celery_zk.broker.queue_limits)."""
    tokens = ((f".{task}" if task else "") + (f"!{limit_key}" if limit_key else "")
              + (f"+{size}" if size is not None else ""))
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
                           message.affinity, message.kind, message.task, message.limit_key,
                           message.size)
            + f"r{message.order:0{SEQ_DIGITS}d}")



def parse_message_name(name: str) -> MessageName | None:
    """Parse a waiting-message name; ``None`` for nodes celery_zk did not write.
    A handed message's copy of its body (:func:`inline_body`) is not part of
    what the name says: it is cut off first, so the cache never holds it."""
    return _parse_message_name(without_body(name))



def slot_of(name: str) -> MessageName | None:
    """The message a slot's name (``~{name}``) was acked from; None for anything else."""
    return parse_message_name(name[len(SLOT):]) if name.startswith(SLOT) else None



def without_body(name: str) -> str:
    """``name`` without the copy of its body a handed message's name may
    carry; any other name as it is, the same object."""
    cut = _body_at(name)
    return name if cut < 0 else name[:cut]



@functools.lru_cache(maxsize=1 << 12)
def _body_at(name: str) -> int:
    """Where the copy of a body in ``name`` starts (its ``~``), or -1. Cached:
    a handed name is cut where it is read, delivered, acked and where its
    task starts, and matching a body that long takes microseconds."""
    cut = name.find(INLINE_SEP)
    if cut < 0 or _parse_message_name(name[:cut]) is None or not _INLINE_RE.fullmatch(
            name, cut + 1):
        return -1
    return cut



def inline_body(name: str) -> bytes | None:
    """The body copied into a handed message's name, or ``None`` (none there,
    or it does not decode: the consumer then reads the body node)."""
    thin = without_body(name)
    if thin is name:
        return None
    text = name[len(thin) + 1:]
    try:
        return zlib.decompress(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except (binascii.Error, ValueError, zlib.error):
        return None



def encode_body(data: bytes) -> str | None:
    """A body as it goes into a handed name; ``None`` when longer than
    :data:`INLINE_CHARS`."""
    if len(data) > INLINE_CHARS * 4:   # no hope of fitting: do not compress it
        return None
    text = base64.urlsafe_b64encode(zlib.compress(data)).rstrip(b"=").decode()
    return text if len(text) <= INLINE_CHARS else None



@functools.lru_cache(maxsize=1 << 14)
def _parse_message_name(name: str) -> MessageName | None:
    """:func:`parse_message_name` of a name without a body. Cached: a message's
    name is parsed where it is listed, sorted, given, read, delivered and
    acked, a dozen times between publish and ack; the result is immutable.
    The cache holds about a listing's worth (~4 MB)."""
    match = _MESSAGE_RE.match(name)
    if not match:
        return None
    kind, inv, generation, uid, task, limit, size, affinity, requeued, seq = match.groups()
    return MessageName(int(inv), int(generation), uid, int(seq), bool(requeued), int(seq),
                       affinity, kind == BODY_CHUNKED, task, limit,
                       None if size is None else int(size))



def parse_legacy_name(name: str) -> MessageName | None:
    """A message name stored before 0.2 (see the module docstring; claimed
    ones without their ``{consumer}~``), parsed as the message it becomes
    once upgraded: its body in bodies/, a flat one in bucket 0."""
    if not name.startswith("m"):
        return None
    message = _parse_message_name("n" + name[1:])
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


def order_key(name: str) -> OrderKey | None:
    """``(sort_key, name)`` of a message name; ``None`` for nodes celery_zk did not
    write. Cached like the parse (on the name without a body's copy): a
    dispatcher orders a bucket's thousands of names at each listing, then
    looks each one up again as it is given."""
    thin = without_body(name)
    key = _order_key(thin)
    return key if thin is name or key is None else (key[0], name)



@functools.lru_cache(maxsize=1 << 14)
def _order_key(name: str) -> OrderKey | None:
    message = _parse_message_name(name)
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



def handed_name(inverted_priority: int, generation: int, uid: str,
                kind: str = BODY_APART, task: str | None = None,
                limit_key: str | None = None, body: str | None = None,
                size: int | None = None) -> str:
    """The name a message handed straight to an idle consumer gets, with
    ``body`` (:func:`encode_body`) as a copy of its body if given.

    It never waited in a bucket, so it has no sequence: zero. Its body is in
    the bucket of ``generation`` like any other's, and a requeue puts it at
    the front of that bucket: it was handed over while the queue was empty,
    ahead of its priority's later arrivals, where it belongs.
    """
    name = (message_prefix(inverted_priority, generation, uid, kind=kind, task=task,
                           limit_key=limit_key, size=size) + "0" * SEQ_DIGITS)
    return name if body is None else f"{name}{INLINE_SEP}{body}"



def promoted_name(message: MessageName) -> str:
    """The name a delayed message waits under once due (:mod:`celery_zk.broker.delayed`):
    in the bucket of its body, at the front of its priority like a handed one
    (order zero), not marked requeued (it was never delivered). Promoted
    messages of a bucket sort among themselves by uid, which starts with the
    due time (:func:`delayed_uid`): earliest due first."""
    return (message_prefix(message.inverted_priority, message.generation, message.uid,
                           message.affinity, message.kind, message.task, message.limit_key,
                           message.size) + "0" * SEQ_DIGITS)


# -- delayed messages: delayed/{day}/{minute}-{gen}/{message name} ------------------
#: A delayed message's bucket holds those due within one minute: the most a
#: dispatcher holds in memory at once is what falls due in a minute (and a
#: bucket's ``bucket_size`` creates, as unowned/'s, before its next generation).
DELAYED_BUCKET_MS = 60_000
#: Buckets sit in a directory per day, so that delayed/ lists as many names as
#: there are days ahead with messages (a year: 366), not minutes (525,600:
#: over jute.maxbuffer).
DELAYED_DAY_MS = 86_400_000
_DUE_DIGITS = 13   # milliseconds since the epoch, until the year 2286
_DELAYED_BUCKET_RE = re.compile(r"^(\d{8,})-(\d{4,})$")


def delayed_uid(due_ms: int, uid: str) -> str:
    """A delayed message's uid: its due time, then ``uid`` (hex digits, as every
    uid), so that a name says when it is due and sorts by it."""
    return f"{due_ms:0{_DUE_DIGITS}d}{uid}"


def due_of(message: MessageName) -> int | None:
    """When a delayed message (one found under delayed/) is due, in ms since the
    epoch; None for a uid not made by :func:`delayed_uid`."""
    due = message.uid[:_DUE_DIGITS]
    return int(due) if len(due) == _DUE_DIGITS and due.isdigit() else None


def delayed_bucket(due_ms: int, generation: int) -> tuple[str, str]:
    """``(day, bucket)``: the directories a message due at ``due_ms`` goes to."""
    minute = due_ms // DELAYED_BUCKET_MS
    return (f"{due_ms // DELAYED_DAY_MS:05d}", f"{minute:08d}-{generation:04d}")


def parse_delayed_bucket(name: str) -> tuple[int, int] | None:
    """``(start in ms since the epoch, generation)`` of a delayed bucket, or ``None``."""
    match = _DELAYED_BUCKET_RE.match(name)
    return (int(match.group(1)) * DELAYED_BUCKET_MS, int(match.group(2))) if match else None


def parse_delayed_day(name: str) -> int | None:
    """The start (ms since the epoch) of a day directory of delayed/, or ``None``."""
    return int(name) * DELAYED_DAY_MS if name.isdigit() else None


def quick_affinity(name: str) -> str | None:
    """The affinity token of a message name known to be ours (a sorted
    listing's), without a full parse: a consumer looks at a thousand names
    per choice. The token runs from the ``@`` after the uid to the ``-``
    before the sequence, which has none."""
    at = name.find("@")
    return None if at < 0 else name[at + 1:name.rindex("-")]
