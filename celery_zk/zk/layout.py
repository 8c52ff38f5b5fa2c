"""Znode layout: every path celery_zk uses is built here, under one root (the
URL's path), from the names of :mod:`celery_zk.zk.names`. The tree it builds
is drawn, with what each node holds, in ``docs/design.md`` (*Znode layout*).
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from kazoo.protocol.paths import join

from .message_names import (
    BODY_APART,
    MessageName,
    bucket_name,
    delayed_bucket,
    message_prefix,
    parse_message_name,
)
from .names import (
    AFFINITY_SHARDS_HEX,
    CHORD_ADDED,
    CHORD_DONE,
    CHORD_LAZY,
    CHORD_SENT,
    CHORD_SIZE,
    EXPIRY_CLEANER,
    OWNER_SEP,
    PAYLOAD_ENTRY,
    QUEUES_EXPIRER,
    QUOTA_LIMITS,
    QUOTA_ROOT,
    QUOTA_STATS,
    RESULT_SHARDS_HEX,
    REVOKED_STAMP,
    REVOKED_TASK,
    PayloadName,
    binding_name,
    chunk_name,
    escape,
    holder_name,
    holding_name,
    parse_consumer_name,
    parse_payload_name,
    payload_name,
    queue_consumer_prefix,
    result_shard,
    unescape,
)


@functools.lru_cache(maxsize=1 << 12)
def _queue_dir(root: str, queue: str, *below: str) -> str:
    """``{root}/queues/{escaped queue}[/below...]``: cached, since a message's
    paths (its body, its inbox entry, its bucket) are built a few times per
    delivery from these few directories (9% of a prefork parent's Python time
    before it was, in a drain)."""
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

    def queue_dropped(self, queue: str) -> str:
        """How many messages the queue dropped undelivered (expired, over its
        length): ``{"expired": n, "dropped": n}``."""
        return _queue_dir(self.root, queue, "dropped")

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
                           limit_key: str | None = None, size: int | None = None) -> str:
        """The path a new message is created at (ZooKeeper appends the sequence)."""
        return join(self.bucket(queue, bucket_name(inverted_priority, generation)),
                    message_prefix(inverted_priority, generation, uid, affinity, kind, task,
                                   limit_key, size))

    # -- delayed messages: waiting for their eta (celery_zk.broker.delayed) ------
    def delayed(self, queue: str, *below: str) -> str:
        """``delayed/{day}/{bucket}/{name}`` (``below``: those parts, or some):
        made by the first delayed message."""
        return _queue_dir(self.root, queue, "delayed", *below)

    def new_delayed_prefix(self, queue: str, due_ms: int, delayed_generation: int,
                           inverted_priority: int, generation: int, uid: str,
                           affinity: str | None = None, kind: str = BODY_APART,
                           task: str | None = None, limit_key: str | None = None,
                           size: int | None = None) -> str:
        """Where a delayed message is created: named as it will wait once due
        (its body in the bucket of ``generation``), in the bucket of its due time."""
        day, bucket = delayed_bucket(due_ms, delayed_generation)
        return join(self.delayed(queue, day, bucket),
                    message_prefix(inverted_priority, generation, uid, affinity, kind, task,
                                   limit_key, size))

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
    def lock(self, key: str) -> str:
        """A singleton task's lock: ephemeral, of the session of the run holding it."""
        return join(self.root, "locks", escape(key))

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

    @property
    def expiry_cleaner(self) -> str:
        """The ephemeral lock of the one process cleaning this root now
        (:mod:`celery_zk.backend.autoexpire`); when the last round ended
        is when :attr:`expiry` itself was last written."""
        return join(self.expiry, EXPIRY_CLEANER)

    @property
    def queues_expirer(self) -> str:
        """The ephemeral lock of the one process deleting unused queues now
        (:mod:`celery_zk.broker.queue_expiry`); when its last round ended is
        when :attr:`queues` itself was last written."""
        return join(self.root, QUEUES_EXPIRER)

    # -- the storage budget (celery_zk.broker.budget) ----------------------------
    @property
    def quota_limits(self) -> str:
        """ZooKeeper's quota on the root: its limits (hard ones, where the
        server enforces quotas, at a margin above the budget)."""
        return QUOTA_ROOT + self.root + "/" + QUOTA_LIMITS

    @property
    def quota_stats(self) -> str:
        """Nodes and bytes under the root, counted by the server itself."""
        return QUOTA_ROOT + self.root + "/" + QUOTA_STATS

    def ancestor_quotas(self) -> list[str]:
        """The limits node a quota on a path above the root would have: such a
        quota counts our nodes, and one of ours below it would take them away."""
        parts = self.root.strip("/").split("/")[:-1]
        return [QUOTA_ROOT + "".join("/" + p for p in parts[:i]) + "/" + QUOTA_LIMITS
                for i in range(len(parts) + 1)]

    @property
    def blocked(self) -> str:
        """Ephemeral nodes of the publishers the budget holds back now."""
        return join(self.root, "blocked")

    def blocked_publisher(self, publisher: str) -> str:
        return join(self.blocked, escape(publisher))

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
