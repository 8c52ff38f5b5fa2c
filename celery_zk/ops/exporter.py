"""``celery zk exporter``: Prometheus metrics of the queues, consumers and servers.

Each scrape takes one :func:`celery_zk.ops.status.collect` report, so it costs
what ``celery zk status`` costs. ``celery_queue_length{queue_name}`` and
``celery_active_consumer_count{queue_name}`` keep danihodovic's
celery-exporter's names and labels, which its dashboards read; the rest are
``celery_zk_*``. A scrape that cannot reach ZooKeeper reports ``celery_zk_up 0``
instead of failing. See ``docs/operations.md``, "Metrics: `celery zk exporter`".
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..features.limits import parse_rate
from .status import Status

logger = logging.getLogger(__name__)

__all__ = ["StatusCollector"]

#: mntr key -> (metric suffix, help): the server figures worth a metric.
SERVER_METRICS = {
    "zk_avg_latency": ("avg_latency_ms", "Average request latency (ms)."),
    "zk_max_latency": ("max_latency_ms", "Largest request latency (ms)."),
    "zk_outstanding_requests": ("outstanding_requests", "Requests queued in the server."),
    "zk_znode_count": ("znode_count", "Nodes in the server's tree."),
    "zk_watch_count": ("watch_count", "Watches set on the server."),
    "zk_approximate_data_size": ("data_size_bytes", "Approximate size of the data tree."),
    "zk_num_alive_connections": ("alive_connections", "Client connections to this server."),
    "zk_followers": ("followers", "Followers (on the leader)."),
    "zk_synced_followers": ("synced_followers", "Followers in sync (on the leader)."),
}


class StatusCollector(Collector):
    """A Prometheus collector that takes a fresh report on every scrape."""

    def __init__(self, report: Callable[[], Status]) -> None:
        self.report = report

    def collect(self) -> Iterator[Any]:
        started = time.monotonic()
        up = GaugeMetricFamily("celery_zk_up", "1 if the last scrape reached ZooKeeper.")
        try:
            status = self.report()
        except Exception as exc:   # a scrape must answer: say the broker is down
            logger.warning("celery_zk exporter: scrape failed: %s: %s",
                           type(exc).__name__, exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from _queue_metrics(status)
        yield from _consumer_metrics(status)
        yield from _limit_metrics(status)
        yield from _budget_metrics(status)
        yield from _result_metrics(status)
        yield from _server_metrics(status)
        took = GaugeMetricFamily("celery_zk_scrape_duration_seconds",
                                 "Seconds the last scrape took.")
        took.add_metric([], time.monotonic() - started)
        yield took


def _queue_metrics(status: Status) -> Iterator[Any]:
    length = GaugeMetricFamily("celery_queue_length", "The number of message in broker queue.",
                               labels=["queue_name"])
    consumers = GaugeMetricFamily("celery_active_consumer_count",
                                  "The number of active consumer in broker queue.",
                                  labels=["queue_name"])
    by_priority = GaugeMetricFamily("celery_zk_queue_waiting",
                                    "Waiting messages by priority.",
                                    labels=["queue_name", "priority"])
    owned = GaugeMetricFamily("celery_zk_queue_owned",
                              "Messages claimed by a live consumer, not yet acked.",
                              labels=["queue_name"])
    dead = GaugeMetricFamily("celery_zk_queue_dead", "Dead letters.", labels=["queue_name"])
    oldest = GaugeMetricFamily("celery_zk_queue_oldest_message_age_seconds",
                               "How long the first message in line has waited "
                               "(0 when none waits).", labels=["queue_name"])
    chunked = GaugeMetricFamily("celery_zk_queue_chunked",
                                "Messages stored in chunks (bigger than chunk_size).",
                                labels=["queue_name"])
    chunked_bytes = GaugeMetricFamily("celery_zk_queue_chunked_bytes",
                                      "Bytes of the messages stored in chunks.",
                                      labels=["queue_name"])
    undelivered = CounterMetricFamily("celery_zk_queue_undelivered",
                                      "Messages the queue dropped undelivered: expired "
                                      "(x-message-ttl, expiration) or over its length.",
                                      labels=["queue_name", "reason"])
    limits = GaugeMetricFamily("celery_zk_queue_limit", "A queue's stored numeric arguments "
                               "(x-max-length, x-max-length-bytes, x-message-ttl, x-expires).",
                               labels=["queue_name", "argument"])
    delayed = GaugeMetricFamily("celery_zk_queue_delayed", "Messages waiting for their eta "
                                "(delivered when due).", labels=["queue_name"])
    next_due = GaugeMetricFamily("celery_zk_queue_next_due_timestamp_seconds",
                                 "When the first delayed message is due (absent when none "
                                 "is delayed).", labels=["queue_name"])
    per_queue: dict[str, int] = {}
    for consumer in status.consumers:
        for name in consumer.queues:
            per_queue[name] = per_queue.get(name, 0) + 1
    for queue in status.queues:
        length.add_metric([queue.name], queue.waiting_total)
        consumers.add_metric([queue.name], per_queue.get(queue.name, 0))
        for priority, count in sorted(queue.waiting.items()):
            by_priority.add_metric([queue.name, str(priority)], count)
        owned.add_metric([queue.name], queue.owned_total)
        dead.add_metric([queue.name], queue.dead)
        oldest.add_metric([queue.name], queue.oldest_age or 0.0)
        chunked.add_metric([queue.name], queue.chunked)
        chunked_bytes.add_metric([queue.name], queue.chunked_bytes)
        undelivered.add_metric([queue.name, "expired"], queue.expired)
        undelivered.add_metric([queue.name, "dropped"], queue.dropped)
        delayed.add_metric([queue.name], queue.delayed)
        if queue.next_due is not None:
            next_due.add_metric([queue.name], queue.next_due)
        for argument, value in sorted(queue.arguments.items()):
            if isinstance(value, int) and not isinstance(value, bool):
                limits.add_metric([queue.name, argument], value)
    yield from (length, consumers, by_priority, owned, dead, oldest, chunked, chunked_bytes,
                undelivered, limits, delayed, next_due)


def _limit_metrics(status: Status) -> Iterator[Any]:
    labels = ["kind", "name"]
    given = GaugeMetricFamily("celery_zk_limit_given_in_window",
                              "Messages given under a rate limit in its current window.",
                              labels=labels)
    rate = GaugeMetricFamily("celery_zk_limit_rate",
                             "A rate limit, in messages per its window.", labels=labels)
    running = GaugeMetricFamily("celery_zk_limit_running",
                                "Messages of a concurrency-limited task owned now.",
                                labels=labels)
    concurrency = GaugeMetricFamily("celery_zk_limit_concurrency",
                                    "A concurrency limit.", labels=labels)
    waiting = GaugeMetricFamily("celery_zk_limit_waiting",
                                "Messages waiting at the queues' heads under a limit.",
                                labels=labels)
    for limit in status.limits:
        key = [limit.kind, limit.name]
        if limit.rate:
            given.add_metric(key, limit.given_in_window or 0)
            rate.add_metric(key, parse_rate(limit.rate)[0])
        if limit.concurrency:
            running.add_metric(key, limit.in_flight or 0)
            concurrency.add_metric(key, limit.concurrency)
        waiting.add_metric(key, limit.waiting)
    yield from (given, rate, running, concurrency, waiting)


def _consumer_metrics(status: Status) -> Iterator[Any]:
    count = GaugeMetricFamily("celery_zk_consumers", "Live consuming connections.")
    count.add_metric([], len(status.consumers))
    yield count


def _budget_metrics(status: Status) -> Iterator[Any]:
    budget = status.budget
    if budget is None:
        return
    used = GaugeMetricFamily("celery_zk_budget_used", "What the root holds, as the "
                             "servers' quota counts it.", labels=["unit"])
    ceiling = GaugeMetricFamily("celery_zk_budget_limit", "The storage budget "
                                "(budget_nodes, budget_bytes; 0: none).", labels=["unit"])
    for unit, held, limit in (("znodes", budget.nodes, budget.max_nodes),
                              ("bytes", budget.bytes, budget.max_bytes)):
        if held is not None:
            used.add_metric([unit], held)
        ceiling.add_metric([unit], limit)
    blocked = GaugeMetricFamily("celery_zk_publishers_blocked",
                                "Publisher processes waiting for the budget now.")
    blocked.add_metric([], len(budget.blocked))
    yield from (used, ceiling, blocked)
    if budget.blocked_since is not None:
        since = GaugeMetricFamily("celery_zk_publishers_blocked_since_seconds",
                                  "When the longest-blocked publisher began waiting "
                                  "(seconds since the epoch).")
        since.add_metric([], budget.blocked_since)
        yield since


def _result_metrics(status: Status) -> Iterator[Any]:
    if status.results is None:
        return
    stored = GaugeMetricFamily("celery_zk_results_stored",
                               "Result, group and chord nodes stored.", labels=["kind"])
    for kind in ("results", "groups", "chords"):
        stored.add_metric([kind], getattr(status.results, kind))
    expired = GaugeMetricFamily("celery_zk_results_expired",
                                "Stored results past result_expires (cleanup removes them).")
    expired.add_metric([], status.results.expired)
    chunked = GaugeMetricFamily("celery_zk_results_chunked",
                                "Results and groups stored in chunks (above chunk_size).")
    chunked.add_metric([], status.results.chunked)
    chunked_bytes = GaugeMetricFamily("celery_zk_results_chunked_bytes",
                                      "Bytes of the results and groups stored in chunks.")
    chunked_bytes.add_metric([], status.results.chunked_bytes)
    yield stored
    yield expired
    yield chunked
    yield chunked_bytes
    if status.results.cleaned_at is not None:
        cleaned = GaugeMetricFamily("celery_zk_results_cleaned_timestamp_seconds",
                                    "When the workers' last round of deleting expired "
                                    "results ended (seconds since the epoch).")
        cleaned.add_metric([], status.results.cleaned_at)
        yield cleaned


def _server_metrics(status: Status) -> Iterator[Any]:
    up = GaugeMetricFamily("celery_zk_server_up", "1 if the server answered mntr or srvr.",
                           labels=["server"])
    leader = GaugeMetricFamily("celery_zk_server_leader",
                               "1 for the leader or a standalone server.", labels=["server"])
    families = {key: GaugeMetricFamily(f"celery_zk_server_{suffix}", text, labels=["server"])
                for key, (suffix, text) in SERVER_METRICS.items()}
    for server, health in sorted(status.servers.items()):
        up.add_metric([server], 0 if "error" in health else 1)
        if "error" in health:
            continue
        state = str(health.get("zk_server_state", ""))
        leader.add_metric([server], 1 if state in ("leader", "standalone") else 0)
        for key, family in families.items():
            value = health.get(key)
            if isinstance(value, (int, float)):
                family.add_metric([server], value)
    yield up
    yield leader
    yield from families.values()
