"""What ``celery zk status``, ``celery zk limit list`` and the exporter say of
the cluster-wide limits (:mod:`celery_zk.features.limits`), from names and
small nodes alone: the rate from the limit's record of give times
(``limits/.../given``), what runs from the names in the queues' inboxes (each
holds a consumer's credit at most), what waits from the head of each queue (the
first bucket of each priority; a queue limit's, all its waiting messages), so a
report stays cheap on any backlog. See ``docs/operations.md``, "Cluster-wide
limits".
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from ..features.limits import QUEUE, LimitStore, parse_rate
from ..zk.client import listings
from ..zk.layout import Layout
from ..zk.message_names import parse_bucket_name, parse_message_name
from ..zk.names import parse_consumer_name

__all__ = ["LimitStatus", "limit_statuses"]


@dataclass
class LimitStatus:
    kind: str                 # "task" or "queue"
    name: str
    rate: str | None
    concurrency: int | None
    key: str | None
    given_in_window: int | None   # rate: given in the last window
    in_flight: int | None         # concurrency: owned now (all keys)
    waiting: int                  # held at the heads of the queues

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def limit_statuses(client: KazooClient, layout: Layout, queues: Iterable[str],
                   waiting_by_queue: dict[str, int] | None = None,
                   now: float | None = None) -> list[LimitStatus]:
    """One status per limit under ``layout``'s root (``queues``: where to count)."""
    store = LimitStore(client, layout)
    limits = store.all()
    if not limits:
        return []
    now = time.time() if now is None else now
    owned, head = _names(client, layout, list(queues))
    owned_by_task = Counter(m.task for m in owned)
    head_by_task = Counter(m.task for m in head)
    statuses = []
    for limit in limits:
        given = None
        if limit.rate:
            _, seconds = parse_rate(limit.rate)
            given = sum(1 for t in store.given(limit) if t > now - seconds)
        if limit.kind == QUEUE:
            waiting = (waiting_by_queue or {}).get(limit.name, 0)
            in_flight = None
        else:
            waiting = head_by_task[limit.token]
            in_flight = owned_by_task[limit.token] if limit.concurrency else None
        statuses.append(LimitStatus("queue" if limit.kind == QUEUE else "task", limit.name,
                                    limit.rate, limit.concurrency, limit.key, given,
                                    in_flight, waiting))
    return statuses


def _names(client: KazooClient, layout: Layout, queues: list[str]) -> tuple[list[Any], list[Any]]:
    """The parsed names owned in every inbox, and at the head of every queue."""
    owned: list[Any] = []
    head: list[Any] = []
    for queue in queues:
        try:
            inboxes = [n for n in client.get_children(layout.owned(queue))
                       if parse_consumer_name(n) == n]
            buckets = sorted(b for b in client.get_children(layout.unowned(queue))
                             if parse_bucket_name(b))
        except NoNodeError:
            continue
        firsts: dict[int, str] = {}
        for bucket in buckets:
            parsed = parse_bucket_name(bucket)
            if parsed is not None:
                firsts.setdefault(parsed[0], bucket)
        inbox_paths = [layout.inbox(queue, i) for i in inboxes]
        for path, names in listings(client, [*inbox_paths, *(layout.bucket(queue, b)
                                                            for b in firsts.values())]):
            into = owned if path in inbox_paths else head
            into += [m for m in map(parse_message_name, names) if m is not None]
    return owned, head


def parse_limit_options(rate: str | None, concurrency: int | None,
                        key: str | None) -> dict[str, Any]:
    """The fields of a limit ``celery zk limit set`` was given (checked by Limit)."""
    if rate is None and concurrency is None:
        raise ValueError("give --rate and/or --concurrency (to remove a limit: "
                         "celery zk limit clear)")
    return {"rate": rate, "concurrency": concurrency, "key": key}
