"""Data-affinity scheduling: a worker prefers the messages whose data it holds.

A task published with an affinity key carries it in its message node's name
(``m{P}-{gen}-{uid}@{key}-{seq}``, :func:`~celery_zk.zk.layout.affinity_token`)::

    process.apply_async((path,), headers={"zk_affinity": "dataset-42"})

A worker says which keys it holds, from a task or a signal, as its cache
changes::

    from celery_zk import affinity
    affinity.hold("dataset-42")          # loaded
    affinity.release("dataset-7")        # evicted
    affinity.holding(cache.keys())       # or: exactly these

Each held key is an ephemeral node ``affinity/{h}/{key}~{worker}-{pid}`` of
the process's ZooKeeper session, so it goes when the process dies. The
worker id is made at import and inherited by forked children: a prefork
worker's pool processes hold keys for their worker. Consumers watch
``affinity/`` (one persistent recursive watch, names only) and so know which
worker holds which key.

Choosing (:func:`choose`, from the names of the listing alone): among the
first :data:`WINDOW` waiting messages *of the best priority*, a consumer takes

1. those whose key its worker holds, and those without a key, in queue order;
2. only when there are none: the messages of *one* key that no live worker
   holds (somebody has to load it), or that another worker holds and this
   consumer has seen wait ``locality_wait`` seconds (delay scheduling, as
   Spark's ``spark.locality.wait``). One key, so its data is loaded once;
   consumers start on different keys (by their place among the live ones),
   and a key a consumer started on counts as held by it for
   ``locality_wait`` seconds (at least one), until its task says so. While
   a started key is not yet held, a consumer that has messages claimed or
   running starts no other.

A message held elsewhere is taken by its holder or, after the wait, by
anyone: none waits forever. A lower priority is never taken while a better
one waits, whatever the keys. Keyed messages are never handed straight to
an idle consumer (:mod:`celery_zk.broker.handoff`): they wait where every consumer
chooses.
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Iterable
from enum import Enum
from itertools import islice
from time import monotonic
from typing import TYPE_CHECKING, Any

from kazoo.client import KazooState
from kazoo.exceptions import NodeExistsError, NoNodeError

from ..exceptions import CeleryZKError
from ..zk.client import CONNECTION_ERRORS, log_failure, multi_failure
from ..zk.layout import Layout, affinity_token, parse_holding_name, quick_affinity
from ..zk.session import SharedSession, weak_callback
from ..zk.watches import NODE_CREATED

if TYPE_CHECKING:
    from ..zk.watches import TreeWatches

__all__ = ["HEADER", "AffinityKeyError", "Board", "choose", "hold", "held", "holding",
           "release"]

logger = logging.getLogger(__name__)

#: The message header that carries a task's affinity key.
HEADER = "zk_affinity"
#: How many waiting messages of the best priority a consumer chooses among.
WINDOW = 1024
#: Least seconds a key this consumer started on counts as its own (see choose).
MIN_STARTED = 1.0
#: Without persistent watches, how often the holdings are listed again (seconds).
RELOAD_EVERY = 5.0
#: This worker: the process that imported celery_zk and the pool processes it forks.
WORKER = uuid.uuid4().hex[:12]

_lock = threading.Lock()
_held: dict[str, str] = {}   # token -> key, held by this process


class AffinityKeyError(CeleryZKError, ValueError):
    """A message's affinity key is not one celery_zk can put in a node name."""


class Where(Enum):
    MINE = "mine"             # this worker holds it
    ELSEWHERE = "elsewhere"   # only other live workers hold it
    NOWHERE = "nowhere"       # no live worker holds it


def affinity_of(message: dict[str, Any]) -> str | None:
    """The affinity token a kombu message's headers ask for (None: none)."""
    headers = message.get("headers") or {}
    key = headers.get(HEADER)
    if key is None:
        return None
    try:
        return affinity_token(key)
    except ValueError as exc:
        raise AffinityKeyError(f"cannot publish this message: {exc}. Nothing was "
                               "written.") from None


# -- what this process holds --------------------------------------------------------
def hold(*keys: object, app: Any = None) -> None:
    """This worker now holds the data of ``keys`` (e.g. loaded into its cache)."""
    tokens = {affinity_token(key): str(key) for key in keys}
    with _lock:
        _held.update(tokens)
    _publish(app)


def release(*keys: object, app: Any = None) -> None:
    """This worker no longer holds the data of ``keys``."""
    tokens = [affinity_token(key) for key in keys]
    with _lock:
        for token in tokens:
            _held.pop(token, None)
    _publish(app)


def holding(keys: Iterable[object], app: Any = None) -> None:
    """This worker holds exactly ``keys`` (one transaction for the change)."""
    tokens = {affinity_token(key): str(key) for key in keys}
    with _lock:
        _held.clear()
        _held.update(tokens)
    _publish(app)


def held() -> frozenset[str]:
    """The keys this process said it holds."""
    with _lock:
        return frozenset(_held.values())


def _publish(app: Any) -> None:
    """Make ZooKeeper say what this process holds, through the broker's session."""
    if app is None:
        from celery import current_app
        app = current_app
    with app.pool.acquire(block=True) as connection:
        transport = connection.transport
        if not hasattr(transport, "affinity"):
            raise CeleryZKError(
                "celery_zk.features.affinity states held keys in ZooKeeper: the broker must be "
                f"zk:// (it is {connection.transport_cls!r})")
        connection.connect()   # a no-op once the pooled connection is up
        transport.affinity.sync()


# -- what every worker holds ----------------------------------------------------------
class Board:
    """Which worker holds which key under one root, as one session sees it, and
    what this process has said it holds there."""

    def __init__(self, session: SharedSession, layout: Layout,
                 watches: TreeWatches | None) -> None:
        self.session = session
        self.layout = layout
        self.watches = watches
        self._holders: dict[str, set[tuple[str, int]]] = {}   # token -> {(worker, pid)}
        self._log: list[tuple[bool, str]] | None = None   # events during a load
        self._loaded_at: float | None = None
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._made: set[str] = set()   # holding paths this process made
        self._pid = os.getpid()
        self._tree_cb = weak_callback(self._on_tree)
        session.add_listener(weak_callback(self._on_state))

    # -- kazoo's threads: record only ------------------------------------------------
    def _on_state(self, state: KazooState) -> None:
        if state == KazooState.LOST:
            self._made = set()   # ZooKeeper dropped them with the session: say it again
            self._loaded_at = None
        elif state != KazooState.CONNECTED:
            self._loaded_at = None   # the watch went with the connection

    def _on_tree(self, event_type: int, path: str) -> None:
        _, _, name = path.rpartition("/")
        parsed = parse_holding_name(name)
        if parsed is None:
            return
        created = event_type == NODE_CREATED
        with self._lock:
            self._apply(self._holders, created, name)
            if self._log is not None:
                self._log.append((created, name))

    @staticmethod
    def _apply(holders: dict[str, set[tuple[str, int]]], created: bool, name: str) -> None:
        parsed = parse_holding_name(name)
        if parsed is None:
            return
        token, worker, pid = parsed
        if created:
            holders.setdefault(token, set()).add((worker, pid))
        else:
            found = holders.get(token)
            if found is not None:
                found.discard((worker, pid))
                if not found:
                    del holders[token]

    # -- the consuming thread ---------------------------------------------------------
    def where(self, token: str) -> Where:
        if token in _held:
            return Where.MINE
        holders = self._holders.get(token)
        if not holders:
            return Where.NOWHERE
        if any(worker == WORKER for worker, _ in list(holders)):
            return Where.MINE   # one of this worker's pool processes
        return Where.ELSEWHERE

    def refresh(self) -> None:
        """Load the holdings if this session has not got them watched."""
        watches = self.watches
        path = self.layout.affinity
        try:
            if _held and (not self._made or self._pid != os.getpid()):
                self.sync()   # after a session expiry, or in a forked child
            if self._loaded_at is not None:
                if watches is not None and watches.supported and watches.active(path):
                    return
                if monotonic() - self._loaded_at < RELOAD_EVERY:
                    return
            self._load(watches)
        except CONNECTION_ERRORS as exc:
            log_failure(logger, exc, "celery_zk: could not read the affinity holdings; "
                        "choosing without them for now")

    def _load(self, watches: TreeWatches | None) -> None:
        client = self.session.client
        with self._lock:
            self._log = []
        try:
            if watches is not None:
                watches.watch(self.layout.affinity, self._tree_cb)   # before the listing
            replies = [client.get_children_async(shard)
                       for shard in self.layout.affinity_shards()]
            fresh: dict[str, set[tuple[str, int]]] = {}
            for reply in replies:
                try:
                    names = reply.get(timeout=self.session.settings.options.session_timeout)
                except NoNodeError:
                    continue
                for name in names:
                    self._apply(fresh, True, name)
            with self._lock:
                # Replay, in order, what the watch reported meanwhile: the listing
                # already holds some of it, and set operations do not mind.
                for created, name in self._log:
                    self._apply(fresh, created, name)
                self._holders = fresh
        finally:
            with self._lock:
                self._log = None
        self._loaded_at = monotonic()

    def sync(self) -> None:
        """Make this process's holding nodes match what it holds: one multi."""
        with self._sync_lock:
            if self._pid != os.getpid():   # forked: the parent's nodes are not ours
                self._made, self._pid = set(), os.getpid()
            pid = os.getpid()
            with _lock:
                want = {self.layout.holding(token, WORKER, pid) for token in _held}
            create, delete = want - self._made, self._made - want
            if not create and not delete:
                return
            client = self.session.client

            def commit() -> bool:
                txn = client.transaction()
                for path in sorted(delete):
                    txn.delete(path)
                for path in sorted(create):
                    txn.create(path, ephemeral=True)
                return multi_failure(txn.commit()) is None

            if not client.retry(commit):
                # A shard not made yet, or a retried multi that had landed: one by
                # one, idempotent (each node stands on its own).
                for path in delete:
                    try:
                        client.retry(client.delete, path)
                    except NoNodeError:
                        pass
                for path in create:
                    try:
                        client.retry(client.create, path, ephemeral=True, makepath=True)
                    except NodeExistsError:
                        pass
            self._made = want


def board_for(session: SharedSession, layout: Layout, watches: TreeWatches | None) -> Board:
    """The session's one board for ``layout``'s root."""
    return session.singleton(("affinity", layout.root), lambda: Board(session, layout, watches))


def choose(names: Iterable[str], limit: int, board: Board, seen: dict[str, float],
           started: dict[str, float], wait: float, index: int = 0, idle: bool = True
           ) -> tuple[list[str], float | None]:
    """Up to ``limit`` of ``names`` (a sorted listing) to claim, and, when none
    can be taken yet, the seconds until one can.

    The caller keeps ``seen`` (when this consumer first saw each message
    held elsewhere) and ``started`` (the keys it started on without holding
    them, and when) across calls. ``index``: this consumer's place among the
    live ones, so consumers without local work start on different keys.
    ``idle``: the consumer has nothing claimed or running.
    """
    now = monotonic()
    recent = max(wait, MIN_STARTED)
    # Started keys bridge the time until the task says it holds the key (from
    # then on the holdings decide, evictions included), or until they expire.
    for key in [key for key, at in started.items()
                if now - at > recent or board.where(key) is Where.MINE]:
        del started[key]
    batch: list[str] = []   # held here (or just started on), or without a key
    free: dict[str, list[str]] = {}   # key -> its messages nobody here may wait for
    best: str | None = None
    soonest: float | None = None
    for name in islice(names, WINDOW):
        priority = name[1]   # "m{P}-…": one digit, inverted (see layout)
        if best is None:
            best = priority
        elif priority != best:
            break   # priority wins over affinity
        token = quick_affinity(name)
        if token is None or token in started:
            batch.append(name)
        else:
            where = board.where(token)
            if where is Where.MINE:
                batch.append(name)
            elif where is Where.NOWHERE:
                free.setdefault(token, []).append(name)
            else:
                due = seen.setdefault(name, now) + wait
                if due <= now:
                    free.setdefault(token, []).append(name)
                elif soonest is None or due < soonest:
                    soonest = due
        if len(batch) >= limit:
            break
    if batch:
        return batch, None
    # A key started on and not yet said to be held is being loaded: start no
    # second one meanwhile (a prefetch window would fill with new keys before
    # any is loaded), unless nothing runs (tasks that never call hold()).
    if free and (idle or not started):
        # No local work: start on one new key (its data is loaded once), a
        # different one for each consumer, rather than on many at once. Until
        # its task says it holds it, the key counts as this consumer's.
        keys = list(free)
        chosen = keys[index % len(keys)]
        started[chosen] = now
        return free[chosen][:limit], None
    return [], None if soonest is None else max(0.0, soonest - now)
