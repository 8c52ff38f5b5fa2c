"""What ``celery zk status`` and the exporter report, read from names and stats.

A report reads ``get_children`` of small directories, node stats
(``numChildren``, ``ctime``) and small nodes, never a message body or a
result, nor a stat per message or per result: it costs a few pipelined round
trips per queue, whatever the backlog. See ``docs/operations.md``, "`celery zk
status`", and ``docs/sizing.md``, "Operations commands".
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from ..backend.expiry import bucket_expired
from ..broker import big, delayed
from ..broker.budget import Use
from ..broker.liveness import consumer_nodes
from ..broker.queue_arguments import read_meta
from ..broker.queue_limits import dropped_counts
from ..server.launcher import four_letter_word
from ..zk.client import children, json_object, reply_or_retry
from ..zk.layout import Layout
from ..zk.message_names import MAX_PRIORITY, parse_bucket_name, sort_messages
from ..zk.names import parse_consumer_name, parse_offer_name, parse_payload_name, unescape
from ..zk.rounds import stamped_at
from .limits import LimitStatus, limit_statuses

__all__ = ["BudgetStatus", "ConsumerStatus", "QueueStatus", "ResultsStatus", "Status", "collect",
           "server_health"]

@dataclass
class QueueStatus:
    name: str
    waiting: dict[int, int] = field(default_factory=dict)   # priority -> messages
    owned: dict[str, int] = field(default_factory=dict)     # consumer id -> messages
    dead: int = 0
    offers: int = 0          # idle consumers waiting for a message of this queue
    oldest_age: float | None = None   # seconds the first message in line has waited
    chunked: int = 0         # messages stored in chunks (waiting, owned or dead)
    chunked_bytes: int = 0   # their bodies' bytes
    arguments: dict[str, Any] = field(default_factory=dict)   # stored: x-max-length, ...
    expired: int = 0         # messages never delivered: expired (x-message-ttl, expiration)
    dropped: int = 0         # or dropped over x-max-length (drop-head)
    delayed: int = 0         # messages waiting for their eta (celery_zk.broker.delayed)
    next_due: float | None = None   # epoch seconds: when the first of them is due

    @property
    def waiting_total(self) -> int:
        return sum(self.waiting.values())

    @property
    def owned_total(self) -> int:
        return sum(self.owned.values())


@dataclass
class ConsumerStatus:
    id: str
    host: str
    pid: int | None
    queues: list[str]
    since: float             # epoch seconds: when it registered
    owned: int = 0


@dataclass
class ResultsStatus:
    root: str
    results: int = 0
    groups: int = 0
    chords: int = 0
    expired: int = 0         # index entries in hours past result_expires
    chunked: int = 0         # results/groups stored in chunks (orphans included)
    chunked_bytes: int = 0   # their bytes, as their containers' names say
    cleaned_at: float | None = None   # when the workers' last cleanup round ended


@dataclass
class BudgetStatus:
    max_nodes: int           # 0: no limit
    max_bytes: int
    nodes: int | None = None   # None: the root has no quota, so nothing counts it
    bytes: int | None = None
    blocked: list[dict[str, Any]] = field(default_factory=list)   # host, pid, queue, since

    @property
    def blocked_since(self) -> float | None:
        return min((b["since"] for b in self.blocked), default=None)


@dataclass
class Status:
    root: str
    queues: list[QueueStatus]
    consumers: list[ConsumerStatus]
    results: ResultsStatus | None
    servers: dict[str, dict[str, Any]]
    took: float = 0.0
    limits: list[LimitStatus] = field(default_factory=list)
    budget: BudgetStatus | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "limits": [limit.as_dict() for limit in self.limits],
            "queues": [{"name": q.name, "waiting": q.waiting_total,
                        "waiting_by_priority": {str(p): n for p, n in sorted(q.waiting.items())},
                        "owned": q.owned_total, "owned_by_consumer": q.owned,
                        "dead": q.dead, "idle_consumers": q.offers,
                        "oldest_waiting_seconds": q.oldest_age,
                        "chunked": q.chunked, "chunked_bytes": q.chunked_bytes,
                        "arguments": q.arguments, "expired": q.expired, "dropped": q.dropped,
                        "delayed": q.delayed, "next_due": q.next_due}
                       for q in self.queues],
            "consumers": [c.__dict__ for c in self.consumers],
            "results": self.results.__dict__ if self.results is not None else None,
            "budget": self.budget.__dict__ if self.budget is not None else None,
            "servers": self.servers,
            "took_seconds": round(self.took, 3),
        }


def collect(client: KazooClient, layout: Layout, hosts: str,
            results_layout: Layout | None = None, result_expires: float | None = None,
            queues: Iterable[str] | None = None, health: bool = True,
            results_client: KazooClient | None = None,
            budget: tuple[int, int] | None = None) -> Status:
    """One report. ``queues``: only these (all by default); ``results_layout``:
    the zk result backend's root, if it has one (read through ``results_client``
    when the backend is on other servers); ``budget``: its
    ``(budget_nodes, budget_bytes)``."""
    started = time.monotonic()
    names = sorted(queues) if queues is not None else queue_names(client, layout)
    now = time.time()
    queue_status = [_queue(client, layout, name, now) for name in names]
    consumers = _consumers(client, layout)
    by_id = {c.id: c for c in consumers}
    for queue in queue_status:
        for consumer_id, count in queue.owned.items():
            if consumer_id in by_id:
                by_id[consumer_id].owned += count
    results = (_results(results_client or client, results_layout, result_expires, now)
               if results_layout is not None else None)
    servers = server_health(hosts) if health else {}
    limits = limit_statuses(client, layout, names,
                            {q.name: q.waiting_total for q in queue_status}, now)
    return Status(layout.root, queue_status, consumers, results, servers,
                  time.monotonic() - started, limits,
                  _budget(client, layout, *budget) if budget is not None else None)


def _budget(client: KazooClient, layout: Layout, max_nodes: int,
            max_bytes: int) -> BudgetStatus:
    status = BudgetStatus(max_nodes, max_bytes)
    stats = _reply_or_none(client.get_async(layout.quota_stats))
    use = Use.parse(stats[0]) if stats is not None else None
    if use is not None:
        status.nodes, status.bytes = use.nodes, use.size
    names = children(client, layout.blocked)
    for reply in [client.get_async(layout.listed(layout.blocked, n)) for n in names]:
        got = _reply_or_none(reply)
        meta = json_object(got[0] if got is not None else None)
        if isinstance(meta.get("since"), (int, float)):
            status.blocked.append(meta)
    return status


def queue_names(client: KazooClient, layout: Layout) -> list[str]:
    return sorted(unescape(n) for n in children(client, layout.queues))


def _queue(client: KazooClient, layout: Layout, queue: str, now: float) -> QueueStatus:
    status = QueueStatus(queue)
    unowned = children(client, layout.unowned(queue))
    buckets = sorted(n for n in unowned if parse_bucket_name(n) is not None)
    # One pipelined round: every bucket's stat, owned/, dead/ and offers/.
    stats = [client.exists_async(layout.bucket(queue, b)) for b in buckets]
    owned = client.get_children_async(layout.owned(queue))
    dead = client.exists_async(layout.dead(queue))
    offers = client.get_children_async(layout.offers(queue))
    meta = client.get_async(layout.queue(queue))
    undelivered = client.get_async(layout.queue_dropped(queue))
    first: dict[int, str] = {}   # priority -> its first non-empty bucket
    for bucket, reply in zip(buckets, stats):
        stat = reply_or_retry(client, reply, client.exists, layout.bucket(queue, bucket))
        if stat is None or not stat.numChildren:
            continue
        inverted, _ = parse_bucket_name(bucket) or (0, 0)
        priority = MAX_PRIORITY - inverted
        status.waiting[priority] = status.waiting.get(priority, 0) + stat.numChildren
        first.setdefault(priority, bucket)
    counts: Counter[str] = Counter()
    inboxes = [name for name in _reply_or_empty(owned) if parse_consumer_name(name) == name]
    for consumer_id, reply in [(c, client.exists_async(layout.inbox(queue, c)))
                               for c in inboxes]:
        stat = _reply_or_none(reply)
        if stat is not None and stat.numChildren:
            counts[consumer_id] += stat.numChildren
    status.owned = dict(counts)
    dead_stat = _reply_or_none(dead)
    status.dead = dead_stat.numChildren if dead_stat is not None else 0
    status.offers = sum(1 for n in _reply_or_empty(offers) if parse_offer_name(n))
    data = _reply_or_none(meta)
    _, status.arguments = read_meta(data[0]) if data else (False, {})
    data = _reply_or_none(undelivered)
    dropped = dropped_counts(data[0]) if data else {}
    status.expired, status.dropped = dropped.get("expired", 0), dropped.get("dropped", 0)
    status.chunked, status.chunked_bytes = big.stored(client, layout, queue)
    status.oldest_age = _oldest_age(client, layout, queue, list(first.values()), now)
    status.delayed, next_due = delayed.stats(client, layout, queue)
    status.next_due = None if next_due is None else next_due / 1000
    return status


def _oldest_age(client: KazooClient, layout: Layout, queue: str, buckets: list[str],
                now: float) -> float | None:
    """Seconds the first message in line of each priority has waited; the longest."""
    heads = []
    listings = [client.get_children_async(layout.bucket(queue, b)) for b in buckets]
    for reply in listings:
        ordered, _ = sort_messages(_reply_or_empty(reply))
        if ordered:
            heads.append(layout.unowned_message(queue, ordered[0]))
    ctimes = [stat.ctime for stat in map(_reply_or_none,
                                         [client.exists_async(p) for p in heads]) if stat]
    return max(0.0, now - min(ctimes) / 1000) if ctimes else None


def _reply_or_empty(reply: Any) -> list[str]:
    try:
        return list(reply.get())
    except NoNodeError:
        return []


def _reply_or_none(reply: Any) -> Any:
    try:
        return reply.get()
    except NoNodeError:
        return None


def _consumers(client: KazooClient, layout: Layout) -> list[ConsumerStatus]:
    consumers = []
    for consumer_id, meta, since in consumer_nodes(client, layout):
        pid = meta.get("pid")
        consumers.append(ConsumerStatus(
            id=consumer_id, host=str(meta.get("host", "")),
            pid=pid if isinstance(pid, int) else None,
            queues=sorted(str(q) for q in meta.get("queues", [])), since=since))
    return consumers


def _results(client: KazooClient, layout: Layout, result_expires: float | None,
             now: float) -> ResultsStatus:
    status = ResultsStatus(layout.root)
    status.results = _sharded_count(client, layout.shards(layout.results))
    status.groups = _sharded_count(client, layout.shards(layout.groups))
    chords = _reply_or_none(client.exists_async(layout.chords))
    status.chords = chords.numChildren if chords is not None else 0
    status.chunked, status.chunked_bytes = _payload_bytes(client, layout)
    status.cleaned_at = stamped_at(client.exists_async(layout.expiry).get())
    if result_expires:
        cutoff = now - result_expires
        hours = [hour for hour in map(layout.parse_expiry_bucket,
                                      children(client, layout.expiry)) if hour is not None]
        status.expired = sum(
            _sharded_count(client, layout.shards(layout.expiry_bucket(hour)))
            for hour in hours if bucket_expired(hour, cutoff))
    return status


def _payload_bytes(client: KazooClient, layout: Layout) -> tuple[int, int]:
    """How many payload containers there are, and their bytes, from names alone."""
    listings = [client.get_children_async(layout.listed(layout.payloads, shard))
                for shard in children(client, layout.payloads)]
    sizes = [parsed.size for reply in listings for parsed in
             map(parse_payload_name, _reply_or_empty(reply)) if parsed is not None]
    return len(sizes), sum(sizes)


def _sharded_count(client: KazooClient, shards: list[str]) -> int:
    stats = [client.exists_async(path) for path in shards]
    return sum(stat.numChildren for stat in map(_reply_or_none, stats) if stat is not None)


def server_health(hosts: str, timeout: float = 2.0) -> dict[str, dict[str, Any]]:
    """``mntr`` of each server (``srvr`` where mntr is not allowed), by host:port."""
    out: dict[str, dict[str, Any]] = {}
    for entry in hosts.split("/")[0].split(","):
        host, _, port = entry.strip().rpartition(":")
        if not host:
            host, port = entry.strip(), "2181"
        key = f"{host}:{port}"
        try:
            reply = four_letter_word(host.strip("[]"), int(port), "mntr", timeout)
            if "not in the whitelist" in reply or "not executed" in reply:
                health = _parse_srvr(four_letter_word(host.strip("[]"), int(port), "srvr",
                                                      timeout))
                health["note"] = ("mntr is not allowed on this server (add it to "
                                  "4lw.commands.whitelist for more); showing srvr")
            else:
                health = _parse_mntr(reply)
        except (OSError, ValueError) as exc:
            health = {"error": f"{type(exc).__name__}: {exc}"}
        out[key] = health
    return out


def _number(value: str) -> Any:
    try:
        return int(value)
    except ValueError:
        try:
            return float(value)
        except ValueError:
            return value


def _parse_mntr(reply: str) -> dict[str, Any]:
    health: dict[str, Any] = {}
    for line in reply.splitlines():
        key, sep, value = line.partition("\t")
        if sep:
            health[key.strip()] = _number(value.strip())
    return health


def _parse_srvr(reply: str) -> dict[str, Any]:
    """srvr's lines, under mntr's names where they mean the same."""
    health: dict[str, Any] = {}
    for line in reply.splitlines():
        key, sep, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if not sep:
            continue
        if key == "Latency min/avg/max":
            parts = value.split("/")
            if len(parts) == 3:
                health["zk_min_latency"], health["zk_avg_latency"], health["zk_max_latency"] = (
                    _number(p) for p in parts)
        elif key == "Outstanding":
            health["zk_outstanding_requests"] = _number(value)
        elif key == "Node count":
            health["zk_znode_count"] = _number(value)
        elif key == "Mode":
            health["zk_server_state"] = value
        elif key == "Connections":
            health["zk_num_alive_connections"] = _number(value)
        elif key.startswith("Zookeeper version"):
            health["zk_version"] = value
    return health
