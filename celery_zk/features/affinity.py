"""Data-affinity scheduling: a worker prefers the messages whose data it holds.

A message's affinity key is in its name
(:func:`~celery_zk.zk.message_names.affinity_token`); a worker states the keys
it holds (:func:`hold`, :func:`release`, :func:`holding`) as ephemeral nodes
``affinity/{h}/{key}~{worker}-{pid}`` of its process's session, so they go
when the process dies, and states them again after a session expiry from a
thread of its own (a pool process consumes nothing that would notice).
Consumers follow ``affinity/`` with one persistent recursive watch (names
only); choosing by key is :mod:`celery_zk.features.locality`. See
``docs/features.md``, "Data-affinity scheduling".
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable
from enum import Enum
from typing import TYPE_CHECKING, Any

from celery import signals
from kazoo.client import KazooState
from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError

from ..exceptions import CeleryZKError
from ..zk.client import delete_if_there, log_failure, multi_failure
from ..zk.layout import Layout
from ..zk.message_names import affinity_token
from ..zk.names import parse_holding_name
from ..zk.session import SharedSession, weak_callback
from ..zk.watches import NODE_CREATED, watches_of

if TYPE_CHECKING:
    from ..zk.watches import TreeWatches

__all__ = ["HEADER", "AffinityKeyError", "Board", "hold", "held", "holding",
           "release"]

logger = logging.getLogger(__name__)

#: The message header that carries a task's affinity key.
HEADER = "zk_affinity"
#: This worker: made again when a worker starts (worker_init); its pool processes inherit it.
WORKER = uuid.uuid4().hex[:12]

_lock = threading.Lock()
_held: dict[str, str] = {}   # token -> key, held by this process


class AffinityKeyError(CeleryZKError, ValueError):
    """A message's affinity key is not one celery_zk can put in a node name."""


AffinityKeyError.__module__ = "celery_zk.affinity"   # its public path (see LockHeld)


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
    _change(lambda held: held.update(tokens), app)


def release(*keys: object, app: Any = None) -> None:
    """This worker no longer holds the data of ``keys``."""
    tokens = [affinity_token(key) for key in keys]

    def drop(held: dict[str, str]) -> None:
        for token in tokens:
            held.pop(token, None)

    _change(drop, app)


def holding(keys: Iterable[object], app: Any = None) -> None:
    """This worker holds exactly ``keys`` (one transaction for the change)."""
    tokens = {affinity_token(key): str(key) for key in keys}

    def replace(held: dict[str, str]) -> None:
        held.clear()
        held.update(tokens)

    _change(replace, app)


def held() -> frozenset[str]:
    """The keys this process said it holds."""
    with _lock:
        return frozenset(_held.values())


def _change(update: Callable[[dict[str, str]], None], app: Any) -> None:
    """Change what this process holds, then say so in ZooKeeper. Every key is
    valid by now; a broker that is not zk:// undoes the change. ZooKeeper away
    does not: the holdings are stated again once it is back."""
    with _lock:
        before = dict(_held)
        update(_held)
    try:
        _publish(app)
    except CeleryZKError:
        with _lock:
            _held.clear()
            _held.update(before)
        raise


def _publish(app: Any) -> None:
    """Make ZooKeeper say what this process holds, through the broker's session."""
    if app is None:
        from celery import current_app
        app = current_app
    with app.pool.acquire(block=True) as connection:
        transport = connection.transport
        if not hasattr(transport, "affinity"):
            raise CeleryZKError(
                "celery_zk.affinity states held keys in ZooKeeper: the broker must be "
                f"zk:// (it is {connection.transport_cls!r}). Nothing is held.")
        try:
            connection.connect()   # a no-op once the pooled connection is up
            transport.affinity.sync()
        except KazooException as exc:
            log_failure(logger, exc, "celery_zk: could not state the held affinity keys; "
                        "stating them again when ZooKeeper answers")


@signals.worker_init.connect(weak=False)
def _new_worker(**_: Any) -> None:
    """A worker starting gets an id of its own, which its pool processes inherit:
    processes forked from one parent that imported celery_zk are still
    different workers."""
    global WORKER
    WORKER = uuid.uuid4().hex[:12]


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()   # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- what every worker holds ----------------------------------------------------------
class Board:
    """Which worker holds which key under one root, as one session sees it, and
    what this process has said it holds there."""

    def __init__(self, session: SharedSession, layout: Layout) -> None:
        self.session = session
        self.layout = layout
        self._holders: dict[str, set[tuple[str, int]]] = {}   # token -> {(worker, pid)}
        self._log: list[tuple[bool, str]] | None = None   # events during a load
        self._loaded = False   # listed, and kept current by the watch since
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._made: set[str] = set()   # holding paths this process made
        self._pid = os.getpid()
        # Bumped when the session ends: a sync that straddles it made nodes that
        # went with it. _unsaid: holdings to state again once connected.
        self._generation = 0
        self._unsaid = False
        self._tree_cb = weak_callback(self._on_tree)
        session.add_listener(weak_callback(self._on_state))

    # -- kazoo's threads: record only ------------------------------------------------
    def _on_state(self, state: KazooState) -> None:
        if state == KazooState.LOST:
            self._generation += 1
            self._made = set()   # ZooKeeper dropped them with the session: say it again
            self._unsaid = True
            self._loaded = False
        elif state != KazooState.CONNECTED:
            self._loaded = False   # the watch went with the connection
        elif self._unsaid and (_held or self._made):
            # A process that only runs tasks (a prefork child) has no consumer
            # that would notice: state them again from a thread of our own,
            # never on kazoo's.
            threading.Thread(target=self._sync_quietly, name="celery_zk-affinity",
                             daemon=True).start()

    def _sync_quietly(self) -> None:
        try:
            self.sync()
        except KazooException as exc:
            log_failure(logger, exc, "celery_zk: could not state the held affinity keys "
                        "again; retrying when ZooKeeper answers")

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

    def seen_by(self, worker: str | None) -> SeenBy:
        """Where keys are held as the worker ``worker`` sees it (a dispatcher
        chooses for consumers of other workers)."""
        return SeenBy(self, worker)

    def refresh(self) -> None:
        """Load the holdings if this session has not got them watched."""
        watches = watches_of(self.session)
        try:
            if (self._unsaid and (_held or self._made)) or (
                    _held and (not self._made or self._pid != os.getpid())):
                self.sync()   # after a session expiry or a failed sync, or in a forked child
            if self._loaded and watches.active(self.layout.affinity):
                return
            self._load(watches)
        except KazooException as exc:   # the choice goes on without them
            log_failure(logger, exc, "celery_zk: could not read the affinity holdings; "
                        "choosing without them for now")

    def _load(self, watches: TreeWatches) -> None:
        client = self.session.client
        with self._lock:
            self._log = []
        try:
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
        self._loaded = True

    def sync(self) -> None:
        """Make this process's holding nodes match what it holds: one multi."""
        with self._sync_lock:
            if self._pid != os.getpid():   # forked: the parent's nodes are not ours
                self._made, self._pid = set(), os.getpid()
            generation = self._generation
            self._unsaid = True   # until this sync has landed
            pid = os.getpid()
            with _lock:
                want = {self.layout.holding(token, WORKER, pid) for token in _held}
            create, delete = want - self._made, self._made - want
            if create or delete:
                self._commit(create, delete)
            if generation == self._generation:
                self._made, self._unsaid = want, False
            # else the session ended meanwhile, and took what we made with it:
            # _made stays empty and the reconnect states everything again.

    def _commit(self, create: set[str], delete: set[str]) -> None:
        client = self.session.client

        def commit() -> bool:
            txn = client.transaction()
            for path in sorted(delete):
                txn.delete(path)
            for path in sorted(create):
                txn.create(path, ephemeral=True)
            return multi_failure(txn.commit()) is None

        if client.retry(commit):
            return
        # A shard not made yet, or a retried multi that had landed: one by one,
        # idempotent (each node stands on its own).
        for path in delete:
            delete_if_there(client, path)
        for path in create:
            try:
                client.retry(client.create, path, ephemeral=True, makepath=True)
            except NodeExistsError:
                pass


class SeenBy:
    """:meth:`Board.where` for another worker than this process's."""

    def __init__(self, board: Board, worker: str | None) -> None:
        self.board = board
        self.worker = worker

    def where(self, token: str) -> Where:
        holders = self.board._holders.get(token)
        if not holders:
            return Where.NOWHERE
        if self.worker is not None and any(w == self.worker for w, _ in list(holders)):
            return Where.MINE
        return Where.ELSEWHERE


def board_for(session: SharedSession, layout: Layout) -> Board:
    """The session's one board for ``layout``'s root."""
    return session.singleton(("affinity", layout.root), lambda: Board(session, layout))
