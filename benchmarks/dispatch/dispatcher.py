"""The dispatcher: the only reader of ``unowned/``, it moves messages into the
inboxes of consumers with free credit."""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

from kazoo.client import KazooClient
from kazoo.protocol.states import WatchedEvent

from . import wire
from .config import (
    BATCH_END,
    BUCKET_SIZE,
    MOVE_BYTES,
    MOVE_MAX,
    Counts,
    Paths,
    Run,
    consumer_ids,
    seq_of,
)

logger = logging.getLogger(__name__)

class Dispatcher:
    """Lists ``unowned/`` alone and moves messages into inboxes with free credit."""

    def __init__(self, client: KazooClient, router: wire.TreeRouter | None, run: Run,
                 counts: Counts) -> None:
        self.client, self.router, self.run_, self.counts = client, router, run, counts
        self.tuning = run.tuning
        self.paths = Paths(run.root)
        self.cids = consumer_ids(run.k)
        self.prefix = "n" if run.names else "m"
        self.wake = threading.Event()
        self.waiting: deque[str] = deque()   # names in delivery order, not yet moved
        self.queued: set[str] = set()        # every name ever put in waiting
        self.listed: set[str] = set()        # buckets listed at least once
        self.exhausted: set[str] = set()     # listed, and no publisher writes there again
        self.refill_due = True
        self.outstanding: dict[str, set[str]] = {cid: set() for cid in self.cids}
        # child credit watches: inboxes to list (all, the first time)
        self.relist_inboxes: set[str] = (set(self.cids) if self.tuning.credit_watch == "child"
                                         else set())
        self.deleted: deque[tuple[str, str]] = deque()   # tree credit: acked entries
        self.arrivals: deque[str] = deque()               # tree unowned: "bucket/name"
        self.inflight: deque[tuple[Any, list[tuple[str, str]]]] = deque()
        self.moving = 0   # move multis sent, not landed
        self.failures: deque[tuple[Any, list[tuple[str, str]]]] = deque()   # inline
        self.reads: dict[str, Any] = {}      # dispatch-copy: body reads under way
        self.turn = 0
        self._unowned_cb = self._on_unowned_child
        self._inbox_cbs = {cid: self._inbox_callback(cid) for cid in self.cids}

    # kazoo's threads ---------------------------------------------------------------
    def _on_unowned_child(self, _event: WatchedEvent) -> None:
        self.counts.events += 1
        self.refill_due = True
        self.wake.set()

    def _inbox_callback(self, cid: str) -> Any:
        def fired(_event: WatchedEvent) -> None:
            self.counts.events += 1
            self.relist_inboxes.add(cid)
            self.wake.set()
        return fired

    def _on_owned_tree(self, kind: int, path: str) -> None:
        self.counts.events += 1
        if kind == wire.NODE_DELETED:
            cid, _, entry = path.partition("/")
            if entry:
                self.deleted.append((cid, entry))
                self.wake.set()

    def _on_unowned_tree(self, kind: int, path: str) -> None:
        self.counts.events += 1
        if kind == wire.NODE_CREATED and path.rpartition("/")[2][:1] == self.prefix:
            self.arrivals.append(path)
            self.wake.set()

    # the dispatcher's thread -----------------------------------------------------
    def prepare(self) -> None:
        if self.tuning.credit_watch == "tree":
            assert self.router is not None
            self.router.watch(self.paths.owned, self._on_owned_tree)
        if self.tuning.unowned_watch == "tree":
            assert self.router is not None
            self.router.watch(self.paths.unowned, self._on_unowned_tree)

    def loop(self, stop: threading.Event) -> None:
        wake = self.wake
        while not stop.is_set():
            wake.clear()
            self.step()
            wake.wait(0.05)

    def step(self) -> None:
        self._settle()
        self._credit()
        self._arrivals()
        # New arrivals matter only once the backlog runs low: until then a fired
        # watch is only noted (the dispatcher's own moves fire it too).
        if len(self.waiting) < 2 * self.run_.k * self.run_.credit and (
                self.refill_due or self._unlisted()):
            self._refill()
        self._assign()

    def _unlisted(self) -> bool:
        return self._buckets_known is None or any(b not in self.listed for b in self._buckets_known)

    _buckets_known: list[str] | None = None

    def _refill(self) -> None:
        """List the buckets not yet exhausted; take the names not yet seen.

        Publishers write only to the newest bucket of a priority, so an older
        one, once listed, has nothing new for the dispatcher (the only one that
        removes names) and is not listed again.
        """
        client, paths, counts = self.client, self.paths, self.counts
        child = self.tuning.unowned_watch == "child"
        self.refill_due = False
        counts.reads += 1
        buckets = sorted(client.get_children(paths.unowned,
                                             watch=self._unowned_cb if child else None))
        self._buckets_known = buckets
        newest = buckets[-1] if buckets else None
        for bucket in buckets:
            if bucket in self.exhausted or (bucket in self.listed and not child):
                continue
            counts.reads += 1
            watch = self._unowned_cb if child and bucket == newest else None
            names = client.get_children(f"{paths.unowned}/{bucket}", watch=watch)
            fresh = [n for n in names if n[0] == self.prefix and n not in self.queued]
            fresh.sort(key=seq_of)
            self.waiting.extend(fresh)
            self.queued.update(fresh)
            self.listed.add(bucket)
            if bucket != newest:
                self.exhausted.add(bucket)
            if len(self.waiting) >= BUCKET_SIZE:
                break

    def _arrivals(self) -> None:
        arrivals = self.arrivals
        while arrivals:
            bucket, _, name = arrivals.popleft().rpartition("/")
            if name not in self.queued:
                self.queued.add(name)
                self.waiting.append(name)
                self.listed.add(bucket)   # its names come by events: no listing needed

    def _credit(self) -> None:
        """What each consumer holds: re-listed inboxes, or acks the tree watch named."""
        deleted = self.deleted
        while deleted:
            cid, entry = deleted.popleft()
            self.outstanding[cid].discard(entry)
        if not self.relist_inboxes:
            return
        cids, self.relist_inboxes = self.relist_inboxes, set()
        client = self.client
        # Pipelined; nothing else is sent until they are back, so each listing
        # shows every move sent before it.
        pending = [(cid, client.get_children_async(self.paths.inbox(cid),
                                                   watch=self._inbox_cbs[cid])) for cid in cids]
        self.counts.reads += len(pending)
        for cid, result in pending:
            self.outstanding[cid] = set(result.get())

    def _settle(self) -> None:
        """Moves that failed go back to the head (a consumer died: its check failed)."""
        inflight, failures = self.inflight, self.failures
        while inflight and inflight[0][0].ready():
            result, moved = inflight.popleft()
            self.moving -= 1
            try:
                results = result.get()
            except Exception as exc:
                results = exc
            if wire.multi_failure(results) is not None:
                failures.append((results, moved))
        while failures:
            results, moved = failures.popleft()
            self.counts.failed += 1
            logger.warning("dispatcher: a move failed: %r", results)
            for cid, entry in reversed(moved):
                self.outstanding[cid].discard(entry)
                self.waiting.appendleft(entry.rstrip(BATCH_END))

    def _read_ahead(self, count: int) -> None:
        """dispatch-copy: start reading the bodies the next moves need."""
        names = [n for n in (self.waiting[i] for i in range(min(count, len(self.waiting))))
                 if n not in self.reads]
        if not names:
            return
        client, paths = self.client, self.paths
        if self.tuning.reads == "multi":
            self.counts.reads += 1
            result = wire.call(client, wire.MultiRead([paths.unowned_of(n) for n in names]))
            for index, name in enumerate(names):
                self.reads[name] = (result, index)
        elif self.tuning.reads == "async":
            self.counts.reads += len(names)
            for name in names:
                self.reads[name] = (client.get_async(paths.unowned_of(name)), None)

    def _body(self, name: str) -> bytes:
        read = self.reads.pop(name, None)
        if read is None:
            self.counts.reads += 1
            return self.client.get(self.paths.unowned_of(name))[0]
        result, index = read
        if index is None:
            return result.get()[0]
        reply = result.get()[index]
        if isinstance(reply, Exception):
            raise reply
        return reply[0]

    def _assign(self) -> None:
        """Fill every inbox with free credit, many consumers in one multi."""
        credit, cids, waiting = self.run_.credit, self.cids, self.waiting
        copy = not self.run_.names
        marks = self.tuning.batches
        # ZooKeeper drops the connection of a request beyond jute.maxbuffer (1 MB):
        # moves that carry bodies are fewer per multi.
        most = max(1, min(MOVE_MAX, MOVE_BYTES // (self.run_.size + 200))) if copy else MOVE_MAX
        while waiting:
            if self.tuning.one_in_flight and self.moving:
                return   # its landing wakes us; what frees meanwhile goes in the next one
            turn = self.turn = (self.turn + 1) % len(cids)
            order = cids[turn:] + cids[:turn]
            free = [(cid, credit - len(self.outstanding[cid])) for cid in order]
            free = [(cid, n) for cid, n in free if n >= self.run_.refill_at]
            if not free:
                return
            if copy:
                self._read_ahead(min(most, sum(n for _, n in free)) + most)
            ops: list[Any] = []
            moved: list[tuple[str, str]] = []
            paths = self.paths
            for cid, n in free:
                take = min(n, len(waiting), most - len(moved))
                if take <= 0:
                    break
                inbox = paths.inbox(cid)
                # The check makes the moves to a consumer that just died fail:
                # its messages stay unowned instead of landing in a dead inbox.
                ops.append(("check", paths.liveness(cid), None))
                for i in range(take):
                    name = waiting.popleft()
                    entry = name + BATCH_END if marks and i == take - 1 else name
                    ops.append(("delete", paths.unowned_of(name), None))
                    ops.append(("create", f"{inbox}/{entry}", self._body(name) if copy else b""))
                    self.outstanding[cid].add(entry)
                    moved.append((cid, entry))
            self._send(ops, moved)
            self.counts.moved += len(moved)

    def _send(self, ops: list[tuple[str, str, bytes | None]], moved: list[tuple[str, str]]) -> None:
        self.counts.writes += 1
        tuning = self.tuning
        self.moving += 1
        if tuning.raw:
            request = wire.multi([wire.check(p) if kind == "check" else wire.delete(p)
                                  if kind == "delete" else wire.create(p, data or b"")
                                  for kind, p, data in ops])
            if tuning.inline:
                def landed(results: Any) -> None:   # connection thread
                    self.moving -= 1
                    if wire.multi_failure(results) is not None:
                        self.failures.append((results, moved))
                        self.wake.set()
                    elif tuning.one_in_flight:
                        self.wake.set()   # the next move may go
                wire.call(self.client, request, wire.Inline(landed, landed))
                return
            result = wire.call(self.client, request)
        else:
            txn = self.client.transaction()
            for kind, path, data in ops:
                if kind == "check":
                    txn.check(path, -1)
                elif kind == "delete":
                    txn.delete(path)
                else:
                    txn.create(path, data or b"")
            result = txn.commit_async()
        self.inflight.append((result, moved))
        if tuning.one_in_flight:
            result.rawlink(lambda _: self.wake.set())
