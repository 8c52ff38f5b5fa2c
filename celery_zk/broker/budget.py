"""The storage budget: the znodes and bytes under a root, as ZooKeeper's own
quota accounting counts them, held below a ceiling by every publisher.

Over it a publish waits (``budget_wait``) for the root to drain, then fails
with :class:`~celery_zk.exceptions.StorageFull`; consumers, acks, results and
publishes to temporary queues go on. The count (``zookeeper_stats`` of the
root's quota) is read in the background at most every :data:`CHECK_EVERY`
seconds, never once per publish; the quota's hard limits, :data:`HARD_MARGIN`
above the budget, are the last line. See ``docs/sizing.md``, "The storage
budget".
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import (
    KazooException,
    NodeExistsError,
    NoNodeError,
    ZookeeperError,
)

from ..compat.kazoo import QuotaExceededError
from ..exceptions import StorageFull
from ..zk.client import CONNECTION_ERRORS
from ..zk.config import ZKOptions
from ..zk.layout import Layout

logger = logging.getLogger(__name__)

#: Seconds a publisher's view of the root's use may be old: what publishers
#: write meanwhile is how far the budget may be overshot (docs/sizing.md).
CHECK_EVERY = 0.5
#: Blocked publishers go on once the use is below this share of the budget.
LOW_WATERMARK = 0.9
#: The quota's hard limits, for servers that enforce them: above the budget,
#: so that only publishers that ignore it (another release, a bug) meet them.
HARD_MARGIN = 1.25


@dataclass(frozen=True)
class Use:
    """What a root holds: znodes and bytes of data."""

    nodes: int
    size: int   # bytes

    @classmethod
    def parse(cls, data: bytes) -> Use | None:
        """A quota stats node's data, ``count=N,bytes=B`` (3.7+ may add more)."""
        fields = dict(part.split("=", 1) for part in data.decode(errors="replace").split(",")
                      if "=" in part)
        try:
            return cls(int(fields["count"]), int(fields["bytes"]))
        except (KeyError, ValueError):
            return None


class Budget:
    """One root's budget as one process sees it (see :func:`budget_for`)."""

    def __init__(self, layout: Layout, options: ZKOptions) -> None:
        self.layout = layout
        self.max_nodes = options.budget_nodes
        self.max_bytes = options.budget_bytes
        self.wait = options.budget_wait
        self.enabled = bool(self.max_nodes or self.max_bytes)
        self.use: Use | None = None
        self.over = False
        self._prepared = False
        self._due = 0.0
        self._reading = False
        self._lock = threading.Lock()
        self._blocked = 0   # threads of this process waiting now
        self._marker = layout.blocked_publisher(
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")

    # -- what publishes call --------------------------------------------------------
    def check(self, client: KazooClient, queue: str, temporary: bool) -> None:
        """Before a publish to ``queue``: returns at once while the root is below
        its budget; over it, waits (``budget_wait``) or raises StorageFull.
        ``temporary`` (auto-delete) queues, Celery's replies and events, are let
        through: they live as long as their consumer, and a worker must keep
        answering while the backlog drains."""
        if not self.enabled:
            return
        if not self._prepared:
            self._prepare(client)
        now = time.monotonic()
        if now >= self._due and not self._reading:
            self._due, self._reading = now + CHECK_EVERY, True
            client.get_async(self.layout.quota_stats).rawlink(self._took)
        if self.over and not temporary:
            self._wait_below(client, queue)

    # -- the quota ----------------------------------------------------------------
    def _prepare(self, client: KazooClient) -> None:
        """Make the root's quota once per process (idempotent across processes);
        without one the budget is off, with a warning that says why."""
        with self._lock:
            if self._prepared:
                return
            try:
                above = [p for p in self.layout.ancestor_quotas() if client.exists(p)]
                if above:
                    self.enabled = False
                    logger.warning(
                        "celery_zk: storage budget off: a quota on a path above the root "
                        "(%s) counts its nodes, and ZooKeeper counts a node in one quota "
                        "only. Use a root outside that path to have the budget.", above[0])
                elif not client.exists(self.layout.quota_stats):
                    self._make_quota(client)
            except CONNECTION_ERRORS:
                return   # not now: the next publish tries again
            except (NoNodeError, ZookeeperError) as exc:   # NoAuth: a locked /zookeeper
                self.enabled = False
                logger.warning(
                    "celery_zk: storage budget off: cannot make the quota that counts "
                    "%s's nodes (%r). Ask the ZooKeeper operator for `setquota -n -1 %s` "
                    "(zkCli), which counts without limiting.",
                    self.layout.root, exc, self.layout.root)
            self._prepared = True

    def _make_quota(self, client: KazooClient) -> None:
        def hard(limit: int) -> int:
            return int(limit * HARD_MARGIN) if limit else -1
        limits = (f"count=-1,bytes=-1,countHardLimit={hard(self.max_nodes)},"
                  f"byteHardLimit={hard(self.max_bytes)}").encode()
        client.ensure_path(self.layout.parent(self.layout.quota_limits))
        for path, data in ((self.layout.quota_limits, limits),
                           (self.layout.quota_stats, b"count=0,bytes=0")):
            try:   # the stats node last: the server starts counting when it appears
                client.create(path, data)
            except NodeExistsError:
                pass   # another process made it first

    def _took(self, result: Any) -> None:
        """kazoo's callback thread: take the reply, never wait."""
        self._reading = False
        if result.successful():
            self._update(Use.parse(result.value[0]))

    def _read_now(self, client: KazooClient) -> None:
        try:
            self._update(Use.parse(client.get(self.layout.quota_stats)[0]))
        except KazooException:
            pass   # a blip or a failover: still over, as far as we know

    def _update(self, use: Use | None) -> None:
        if use is None:
            return
        self.use = use
        if self._full(use, 1.0):
            self.over = True
        elif not self._full(use, LOW_WATERMARK):
            self.over = False

    def _full(self, use: Use, share: float) -> bool:
        return bool(self.max_nodes and use.nodes >= self.max_nodes * share
                    or self.max_bytes and use.size >= self.max_bytes * share)

    # -- over the budget ------------------------------------------------------------
    def _wait_below(self, client: KazooClient, queue: str) -> None:
        deadline = time.monotonic() + self.wait
        with self._marked(client, queue):
            while True:
                self._read_now(client)
                if not self.over:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StorageFull(self._full_message())
                time.sleep(min(CHECK_EVERY, left))

    def _full_message(self) -> str:
        use = self.use or Use(0, 0)
        ceiling = (f"{self.max_nodes:,} znodes" if self.max_nodes else "no znode limit",
                   f"{self.max_bytes / 2**20:,.1f} MiB" if self.max_bytes else "no byte limit")
        return (f"celery_zk's storage budget for {self.layout.root} is full: it holds "
                f"{use.nodes:,} znodes, {use.size / 2**20:,.1f} MiB; the budget is "
                f"{', '.join(ceiling)} (options budget_nodes, budget_bytes). This publish "
                f"waited {self.wait:g} s (option budget_wait) for consumers to drain it below "
                f"{LOW_WATERMARK:.0%}, and nothing was written. " + _ADVICE)

    @contextmanager
    def _marked(self, client: KazooClient, queue: str) -> Iterator[None]:
        """An ephemeral node while any thread of this process is held back, for
        ``celery zk status`` (blocked since when)."""
        with self._lock:
            self._blocked += 1
            if self._blocked == 1:
                logger.warning("celery_zk: publishing to %r waits: the storage budget of "
                               "%s is full (celery zk status shows it)", queue,
                               self.layout.root)
                data = json.dumps({"since": time.time(), "queue": queue,
                                   "host": socket.gethostname(), "pid": os.getpid()})
                try:
                    client.create(self._marker, data.encode(), ephemeral=True, makepath=True)
                except (NodeExistsError, KazooException):
                    pass   # status only; the wait itself does not depend on it
        try:
            yield
        finally:
            with self._lock:
                self._blocked -= 1
                if self._blocked == 0:
                    try:
                        client.delete(self._marker)
                    except KazooException:
                        pass   # gone with a session, or a blip: it is ephemeral


_ADVICE = ("Start or scale the workers of the backlog (`celery zk status` shows where "
           "it is), purge what is not needed, or raise the budget if every ZooKeeper "
           "server's heap allows (docs/sizing.md).")


def refused(layout: Layout, error: QuotaExceededError) -> StorageFull:
    """The servers' quota refused a write: the same advice as the budget's."""
    return StorageFull(
        f"ZooKeeper refused the write: the quota on {layout.root} is enforced by the "
        f"servers (zookeeper.enforceQuota) and reached ({error!r}). Nothing was written. "
        f"celery_zk sets its hard limits {HARD_MARGIN}x above the budget (options "
        "budget_nodes, budget_bytes), so something publishes without it, or the quota in "
        f"{layout.quota_limits} was set lower by hand. " + _ADVICE)


_budgets: dict[tuple[Any, ...], Budget] = {}
_budgets_lock = threading.Lock()


def budget_for(hosts: str, layout: Layout, options: ZKOptions) -> Budget:
    """The process's one budget per ensemble, root and setting: every connection
    of a process shares its reads of the root's use."""
    key = (os.getpid(), hosts, layout.root, options.budget_nodes,
           options.budget_bytes, options.budget_wait)
    with _budgets_lock:
        budget = _budgets.get(key)
        if budget is None:
            budget = _budgets[key] = Budget(layout, options)
        return budget
