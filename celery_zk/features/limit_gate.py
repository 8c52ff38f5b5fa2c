"""Holding cluster-wide limits (:mod:`celery_zk.features.limits`) at the two
places a message passes: where it is given, and where it starts.

:class:`Gate` admits, in each round of the queue's dispatcher, only what the
limits allow (the give times of a rate go in the multi that gives), and the
messages behind a held one go on. :func:`hold_rate_at_start` makes a worker
process wait for the window by a compare-and-set on ``limits/.../started``:
given evenly, messages may still start together, so this is what makes the
rate hold on starts. See ``docs/features.md``, "Cluster-wide rate and
concurrency limits".
"""
from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from celery.signals import task_prerun
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from ..zk.layout import Layout
from ..zk.message_names import MessageName
from .limits import QUEUE, TASK, Book, Limit, book_for, parse_rate

__all__ = ["GIVE_MARGIN", "RATE_LIMITED", "START_MARGIN", "Gate", "hold_rate_at_start",
           "rate_limited"]

logger = logging.getLogger(__name__)

#: Seconds added to a rate limit's window where tasks start (see hold_rate_at_start).
START_MARGIN = 0.05
#: Seconds added to a rate limit's window where the dispatcher gives: more than
#: START_MARGIN, so gives come a little slower than starts may. Were they as
#: fast, the starts' longer window would fall behind over a long backlog, and
#: tasks waiting in hold_rate_at_start would fill the pool's slots, holding up
#: the unlimited tasks behind them.
GIVE_MARGIN = 2 * START_MARGIN
#: How long a start's write took to be answered lately, in this process.
_latency = 0.0
#: A message property the consuming process sets on each delivery: whether a
#: rate limit was known then (True) or none was (False). The process a task runs
#: in holds a rate limit as the task starts, through a ZooKeeper session; told
#: False, a prefork child needs none (its pool made one per child otherwise,
#: each counted against ZooKeeper's 60 connections per client IP).
RATE_LIMITED = "celery_zk_rate_limited"


def rate_limited(limits: Iterable[Limit]) -> bool:
    """Whether any of ``limits`` has a rate, which a task's start may have to hold."""
    return any(limit.rate for limit in limits)


class Gate:
    """One dispatch round's admission: which waiting messages may be given now.

    ``owned``: every message given and not acked (the consumers' inboxes), for
    concurrency; ``given``: the recent give times of each rate-limited limit.
    """

    def __init__(self, limits: Iterable[Limit], queue: str, owned: Iterable[MessageName],
                 given: dict[tuple[str, str], list[float]], now: float | None = None) -> None:
        self.now = time.time() if now is None else now
        limits = list(limits)
        self.queue_limit = next((lim for lim in limits
                                 if lim.kind == QUEUE and lim.name == queue), None)
        self.by_token = {lim.token: lim for lim in limits if lim.kind == TASK}
        self.retry_in: float | None = None
        self.given = given
        self.taken: dict[tuple[str, str], int] = {}   # rate-limited gives this round
        in_flight: dict[tuple[str | None, str | None], int] = {}
        for message in owned:
            key = (message.task, message.limit_key)
            in_flight[key] = in_flight.get(key, 0) + 1
        self.in_flight = in_flight

    @property
    def active(self) -> bool:
        return self.queue_limit is not None or bool(self.by_token)

    def _rate_room(self, limit: Limit) -> int:
        """How many more may be given now; when none, notes when one may."""
        count, seconds = parse_rate(limit.rate or "")
        seconds += GIVE_MARGIN
        ident = (limit.kind, limit.name)
        times = sorted(t for t in self.given.get(ident, []) if t > self.now - seconds)
        times += [self.now] * self.taken.get(ident, 0)
        room = count - len(times)
        if room <= 0:   # the oldest of the last `count` leaves the window then
            due = max(0.001, times[-count] + seconds - self.now)
            self.retry_in = due if self.retry_in is None else min(self.retry_in, due)
        return room

    def admit(self, message: MessageName) -> bool:
        """Whether ``message`` may be given now; counts it if so."""
        limits: list[Limit] = []
        if self.queue_limit is not None and self.queue_limit.rate:
            if self._rate_room(self.queue_limit) <= 0:
                return False
            limits.append(self.queue_limit)
        limit = self.by_token.get(message.task) if message.task else None
        if limit is not None:
            if limit.rate and self._rate_room(limit) <= 0:
                return False
            if limit.concurrency:
                key = (message.task, message.limit_key if limit.key else None)
                used = (self.in_flight.get(key, 0) if limit.key else
                        sum(n for (task, _), n in self.in_flight.items()
                            if task == message.task))
                if used >= limit.concurrency:
                    return False
                self.in_flight[key] = self.in_flight.get(key, 0) + 1
            if limit.rate:
                limits.append(limit)
        for counted in limits:
            ident = (counted.kind, counted.name)
            self.taken[ident] = self.taken.get(ident, 0) + 1
        return True

    def records(self) -> Iterator[tuple[Limit, list[float]]]:
        """For each rate limit this round gave under: its new record of give
        times (the last ``count``), to store in the multi that gives them."""
        for ident, n in self.taken.items():
            limit = (self.queue_limit if self.queue_limit is not None
                     and ident == (QUEUE, self.queue_limit.name)
                     else next(lim for lim in self.by_token.values()
                               if (lim.kind, lim.name) == ident))
            count, _ = parse_rate(limit.rate or "")
            times = [*self.given.get(ident, []), *[self.now] * n][-count:]
            yield limit, times


# -- where a task starts ---------------------------------------------------------------
def hold_rate_at_start(client: Any, layout: Layout, limit: Limit) -> float:
    """Wait until ``limit``'s window allows one more start, and count it (a
    compare-and-set on its record of start times, so starts in every process
    count once); the seconds waited."""
    global _latency
    count, seconds = parse_rate(limit.rate or "")
    # A start is counted when its write is sent; the task's code runs once the
    # write is answered (a synced write: milliseconds, more on a busy server).
    # The window is taken that much longer, with twice the answer time seen
    # lately, so starts stay within the limit as the tasks themselves see them.
    seconds += START_MARGIN + 2 * _latency
    path = layout.limit_started(limit.kind, limit.name)
    waited = 0.0
    while True:
        try:
            data, stat = client.retry(client.get, path)
        except NoNodeError:
            try:
                client.retry(client.create, path, b"[]")
            except NodeExistsError:
                pass
            except NoNodeError:
                return waited   # the limit was cleared meanwhile
            continue
        at = time.time()
        try:
            times = sorted(float(t) for t in json.loads(data or b"[]") if t > at - seconds)
        except (ValueError, TypeError):
            times = []
        if len(times) < count:
            try:
                client.retry(client.set, path, json.dumps([*times, at][-count:]).encode(),
                             version=stat.version)
                _latency = max(time.time() - at, 0.8 * _latency)   # decays slowly
                return waited
            except BadVersionError:
                continue   # another start counted meanwhile: look again
            except NoNodeError:
                return waited
        pause = times[-count] + seconds - at + random.uniform(0, 0.01)
        time.sleep(max(0.001, pause))
        waited += max(0.001, pause)


@task_prerun.connect(weak=False)
def _before_a_task_starts(sender: Any = None, task: Any = None, **_: Any) -> None:
    """In the process a task runs in: hold its rate limit (and its queue's)."""
    task = task or sender
    app = getattr(task, "app", None)
    if app is None:
        return
    properties = getattr(getattr(task, "request", None), "properties", None)
    if isinstance(properties, dict) and properties.get(RATE_LIMITED) is False:
        return   # delivered by celery_zk, which knew of no rate limit: no session needed
    found = _limits_of(app)
    if found is None:
        return
    handle, layout, book = found
    limits = book.current()
    if not limits:
        return
    info = getattr(task.request, "delivery_info", None) or {}
    queue = info.get("routing_key")
    for limit in limits:
        if not limit.rate:
            continue
        if (limit.kind == QUEUE and limit.name == queue) or (
                limit.kind != QUEUE and limit.name == task.name):
            waited = hold_rate_at_start(handle.client, layout, limit)
            if waited > 0.5:
                logger.debug("celery_zk: %s waited %.2f s for its rate limit %s",
                             task.name, waited, limit.rate)


def _limits_of(app: Any) -> tuple[Any, Layout, Book] | None:
    """The lease, layout and limits of ``app``'s ``zk://`` broker; None when its
    broker is not ``zk://``. Looked up once per app and process (every task
    start asks: Celery's configuration lookups cost more than the check)."""
    pid = os.getpid()
    cached = _apps.get(app)
    if cached is not None and cached[0] == pid:
        return cached[1]
    url = str(app.conf.get("broker_url") or "")
    if not url.startswith("zk://"):
        _apps[app] = (pid, None)
        return None
    from ..zk.config import parse_url
    from ..zk.session import ClientHandle

    with _handles_lock:
        handle = _handles.get(url)
        if handle is None:
            settings = parse_url(url, app.conf.get("broker_transport_options"))
            handle = _handles[url] = ClientHandle(settings)
    layout = Layout(handle.settings.root)
    result = (handle, layout, book_for(handle.session, layout))
    _apps[app] = (pid, result)
    return result


#: app -> (pid, what _limits_of found for it): a forked child looks again.
_apps: weakref.WeakKeyDictionary[Any, tuple[int, tuple[Any, Layout, Book] | None]] = (
    weakref.WeakKeyDictionary())
#: One lease per broker URL in this process (the session is shared anyway).
_handles: dict[str, Any] = {}
_handles_lock = threading.Lock()
