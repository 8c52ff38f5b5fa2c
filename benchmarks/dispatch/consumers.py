"""The consumers of the model: today's self-claiming one, and a dispatcher's
(which watches only its own inbox), with their coalesced acks."""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import WatchedEvent

from . import wire
from .config import (
    ACK_DELAY,
    ACK_MAX,
    BATCH_END,
    LISTING_MAX_AGE,
    MOVE_MAX,
    Counts,
    Paths,
    Report,
    Run,
    Tuning,
    body_index,
    body_time,
    seq_of,
)


class Acker:
    """Acks coalesced: one multi of deletes per batch.

    Sent when ``ACK_MAX`` are pending, the oldest waited ``ACK_DELAY``, or the
    consumer has nothing else in hand (credit frees only when the deletes
    commit, so holding them then would only stall it). With the tuning's
    ``one_in_flight``, never while the previous ack multi is on its way
    (unless ``ACK_MAX`` are pending): acks wait for it, so batches grow with
    the load by themselves. Completion runs on a kazoo thread: it counts, and
    hands the entries back to the consumer thread through ``done`` (only that
    thread touches its own sets).
    """

    def __init__(self, client: KazooClient, tuning: Tuning, counts: Counts, report: Report,
                 progress: Any, slot: int, wake: threading.Event) -> None:
        self.client, self.tuning, self.counts, self.report = client, tuning, counts, report
        self.progress, self.slot = progress, slot
        self.paths: list[str] = []
        self.indices: list[int] = []
        self.keys: list[str] = []
        self.first = 0.0
        self.sent = 0                         # messages in ack multis sent (consumer thread)
        self.multis_sent = 0
        self.committed = 0                    # written by the completion side only
        self.multis_landed = 0                # likewise
        self.done: deque[list[str]] = deque()
        self.wake = wake
        # Woken by every commit only if it frees something this consumer waits
        # for (selfclaim's credit, an offer); a dispatcher's consumer does not.
        self.wake_on_commit = False

    @property
    def flying(self) -> bool:
        return self.multis_sent != self.multis_landed

    @property
    def unsettled(self) -> int:
        """Messages processed whose ack has not committed."""
        return len(self.indices) + self.sent - self.committed

    def add(self, paths: list[str], index: int, key: str) -> None:
        if not self.paths:
            self.first = time.monotonic()
        self.paths.extend(paths)
        self.indices.append(index)
        self.keys.append(key)

    def due(self, idle: bool) -> bool:
        if not self.indices:
            return False
        if len(self.indices) >= ACK_MAX:
            return True
        if self.tuning.one_in_flight and self.flying:
            return False   # the landing wakes us
        return idle or time.monotonic() - self.first >= ACK_DELAY

    def wait_time(self) -> float | None:
        if not self.indices or (self.tuning.one_in_flight and self.flying):
            return None
        return max(0.0, self.first + ACK_DELAY - time.monotonic())

    def flush(self) -> None:
        paths, indices, keys = self.paths, self.indices, self.keys
        self.paths, self.indices, self.keys = [], [], []
        self.counts.writes += 1
        self.counts.ack_multis += 1
        self.sent += len(indices)
        self.multis_sent += 1
        tuning = self.tuning

        def finish(results: Any) -> None:
            self.multis_landed += 1
            if wire.multi_failure(results) is not None:
                self.counts.failed += 1
                self.report.errors.append(f"ack of {keys[:3]}... failed: {results!r}"[:300])
                return
            self.report.acked.extend(indices)
            self.report.last_ack = time.monotonic()
            self.committed += len(indices)
            self.progress[self.slot] = self.committed
            self.done.append(keys)
            if self.wake_on_commit or (tuning.one_in_flight and self.indices):
                self.wake.set()

        if tuning.inline:
            wire.call(self.client, wire.multi([wire.delete(p) for p in paths]),
                      wire.Inline(finish, finish))
            return
        if tuning.raw:
            result = wire.call(self.client, wire.multi([wire.delete(p) for p in paths]))
        else:
            txn = self.client.transaction()
            for path in paths:
                txn.delete(path)
            result = txn.commit_async()

        def landed(result: Any) -> None:   # kazoo's completion thread
            try:
                finish(result.get())
            except Exception as exc:
                finish(exc)
        result.rawlink(landed)


# -- consumers --------------------------------------------------------------------------
class Consumer:
    """What every consumer shares: a loop on the consuming thread, woken by watches."""

    def __init__(self, client: KazooClient, router: wire.TreeRouter | None, run: Run,
                 cid: str, report: Report, progress: Any, slot: int, holds: Any) -> None:
        self.client, self.router, self.run_, self.cid = client, router, run, cid
        self.tuning = run.tuning
        self.paths = Paths(run.root)
        self.report = report
        self.counts = report.counts
        self.holds = holds                        # latency modes: (index, time held)
        self.wake = threading.Event()
        self.acker = Acker(client, run.tuning, self.counts, report, progress, slot, self.wake)

    def prepare(self) -> None:
        """Set up watches before the run starts."""

    def step(self) -> bool:
        raise NotImplementedError

    def held(self, data: bytes) -> int:
        index = body_index(data)
        now = time.monotonic()
        if self.holds is not None:
            self.holds.put((index, now))
        elif self.run_.mode == "steady":
            self.report.latencies.append((now - body_time(data)) * 1000)
        return index

    def loop(self, stop: threading.Event) -> None:
        wake = self.wake
        while not stop.is_set():
            wake.clear()
            if not self.step():
                wait = self.acker.wait_time()
                wake.wait(0.05 if wait is None else wait)
        while self.acker.indices:   # a test run stopped early: send what is pending
            self.acker.flush()

    def read_many(self, paths: list[str]) -> list[tuple[bytes, int] | Exception]:
        """Bodies and versions of ``paths``, the way the tuning says."""
        client, counts = self.client, self.counts
        reads = self.tuning.reads
        if reads == "multi":
            counts.reads += 1
            result = wire.call(client, wire.MultiRead(paths))
            return list(result.get())
        out: list[tuple[bytes, int] | Exception] = []
        if reads == "seq":
            for path in paths:
                counts.reads += 1
                try:
                    data, stat = client.get(path)
                    out.append((data, stat.version))
                except NoNodeError as exc:
                    out.append(exc)
            return out
        counts.reads += len(paths)
        pending = [client.get_async(path) for path in paths]
        for result in pending:
            try:
                data, stat = result.get()
                out.append((data, stat.version))
            except NoNodeError as exc:
                out.append(exc)
        return out


class SelfClaimConsumer(Consumer):
    """Today's celery_zk: list the head, take a slice, read, claim with one multi."""

    def __init__(self, *args: Any, place: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.place = place
        self.listing: deque[str] = deque()
        self.listed_at = 0.0
        self.stale = True
        self.armed = False
        self.claimed = 0
        self._on_child_cb = self._on_child
        self.acker.wake_on_commit = True   # an ack frees credit: claim more

    def _on_child(self, _event: WatchedEvent) -> None:   # kazoo's event thread
        self.counts.events += 1
        self.stale = True
        self.armed = False
        self.wake.set()

    def _list(self) -> None:
        """As celery_zk's listing: buckets, then buckets in order until some names."""
        client, paths = self.client, self.paths
        self.stale = False
        self.counts.reads += 1
        buckets = sorted(client.get_children(paths.unowned, watch=self._on_child_cb))
        names: list[str] = []
        for bucket in buckets:
            self.counts.reads += 1
            children = client.get_children(f"{paths.unowned}/{bucket}", watch=self._on_child_cb)
            names += [name for name in children if name[0] == "m"]
            if len(names) >= MOVE_MAX:
                break
        names.sort(key=seq_of)   # one priority: (gen, seq) order; a bucket at a time
        self.listing = deque(names)
        self.listed_at = time.monotonic()
        self.armed = not names

    def _pick(self, limit: int) -> list[str]:
        """The head, or on a long listing this consumer's own slice of it."""
        listing = self.listing
        offset = self.place * limit if self.run_.k > 1 else 0
        if len(listing) >= offset + limit:
            batch = [listing[offset + i] for i in range(limit)]
            for _ in range(limit):
                del listing[offset]
            return batch
        return [listing.popleft() for _ in range(min(limit, len(listing)))]

    def step(self) -> bool:
        while self.acker.done:
            self.acker.done.popleft()
        free = self.run_.credit - (self.claimed - self.acker.committed)
        worked = False
        if free > 0 and not (self.armed and not self.stale):
            if (not self.listing or self.stale
                    or time.monotonic() - self.listed_at > LISTING_MAX_AGE):
                self._list()
            if self.listing:
                self._claim(self._pick(free))
                worked = True   # claimed, or lost to others: look again at once
        if self.acker.due(idle=True):
            self.acker.flush()
        return worked

    def _claim(self, batch: list[str]) -> None:
        paths, counts = self.paths, self.counts
        results = self.read_many([paths.unowned_of(name) for name in batch])
        candidates: list[tuple[str, bytes, int]] = []
        for name, result in zip(batch, results):
            if isinstance(result, Exception):
                counts.gone_reads += 1   # another consumer took it: dropped from the listing
            else:
                candidates.append((name, result[0], result[1]))
        while candidates:
            owned = [f"{paths.owned}/{self.cid}~{name}" for name, _, _ in candidates]
            counts.writes += 1
            if self.tuning.raw:
                ops: list[Any] = []
                for (name, data, version), path in zip(candidates, owned):
                    ops.append(wire.Delete(paths.unowned_of(name), version))
                    ops.append(wire.create(path, data))
                results_ = wire.call(self.client, wire.multi(ops)).get()
            else:
                txn = self.client.transaction()
                for (name, data, version), path in zip(candidates, owned):
                    # One multi: the message is unowned or owned, never neither.
                    txn.delete(paths.unowned_of(name), version=version)
                    txn.create(path, data)
                results_ = txn.commit()
            failure = wire.multi_failure(results_)
            if failure is None:
                self.claimed += len(candidates)
                for (name, data, _), path in zip(candidates, owned):
                    self.acker.add([path], self.held(data), name)
                return
            counts.failed += 1   # another consumer was first: drop that one, retry the rest
            candidates.pop(failure[0] // 2)


class InboxConsumer(Consumer):
    """A consumer of the dispatch designs: watches its own inbox only.

    With ``offers`` (latency part (b)) it also leaves an ephemeral offer when
    idle, which a publisher deletes in the multi that writes into the inbox.
    """

    def __init__(self, *args: Any, offers: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.inbox = self.paths.inbox(self.cid)
        self.offers = offers
        self.offered = False
        self.seen: set[str] = set()          # read or being read, until the ack commits
        self.arrivals: deque[str] = deque()  # tree watch: entries named by events
        self.relist = self.tuning.inbox_watch == "child"
        self.bodies: deque[tuple[str, bytes]] = deque()   # inline: read, not yet processed
        self.reading = 0                      # inline: entries whose read is under way
        self.batch: list[str] = []            # inline: entries whose batch has not ended
        self._on_child_cb = self._on_child
        if offers:
            self.acker.wake_on_commit = True   # idle again once acked: offer again

    def prepare(self) -> None:
        if self.tuning.inbox_watch == "tree":
            assert self.router is not None
            callback = self._on_tree_inline if self.tuning.inline else self._on_tree
            self.router.watch(self.inbox, callback)
        if self.offers:
            self._offer()

    # kazoo's threads: record and wake (inline: start the read right here)
    def _on_child(self, _event: WatchedEvent) -> None:
        self.counts.events += 1
        self.relist = True
        self.wake.set()

    def _on_tree(self, kind: int, name: str) -> None:
        if kind == wire.NODE_CREATED and name:
            self.counts.events += 1
            self.arrivals.append(name)
            if not self.tuning.batches or name.endswith(BATCH_END):
                self.wake.set()   # batches: once the batch is complete

    def _on_tree_inline(self, kind: int, name: str) -> None:
        """On kazoo's connection thread: send the read now, without a hand-off
        (batches: once the batch's last entry came, one request for all)."""
        if kind != wire.NODE_CREATED or not name:
            return
        self.counts.events += 1
        if self.tuning.batches:
            self.batch.append(name)
            if not name.endswith(BATCH_END):
                return
            names, self.batch = self.batch, []
        else:
            names = [name]
        self.reading += len(names)
        client = self.client
        if self.tuning.reads == "multi" and len(names) > 1:
            self.counts.reads += 1

            def landed_all(replies: Any) -> None:   # connection thread again
                self.reading -= len(names)
                if isinstance(replies, BaseException):
                    replies = [replies] * len(names)
                for entry, reply in zip(names, replies):
                    if isinstance(reply, BaseException):
                        self.report.errors.append(f"read of {entry} failed: {reply!r}")
                    else:
                        self.bodies.append((entry, reply[0]))
                self.wake.set()
            wire.call(client, wire.MultiRead([self._body_path(n) for n in names]),
                      wire.Inline(landed_all, landed_all))
            return
        for entry in names:
            self.counts.reads += 1

            def landed(reply: Any, entry: str = entry) -> None:   # connection thread again
                self.reading -= 1
                if isinstance(reply, BaseException):
                    self.report.errors.append(f"read of {entry} failed: {reply!r}")
                    return
                self.bodies.append((entry, reply[0]))
                self.wake.set()
            wire.call(client, wire.get(self._body_path(entry)), wire.Inline(landed, landed))

    # the consuming thread
    def _body_path(self, entry: str) -> str:
        if self.run_.names and not entry.startswith("h-"):
            return self.paths.body_of(entry.rstrip(BATCH_END))
        return f"{self.inbox}/{entry}"

    def _ack_paths(self, entry: str) -> list[str]:
        if self.run_.names and not entry.startswith("h-"):
            return [f"{self.inbox}/{entry}", self.paths.body_of(entry.rstrip(BATCH_END))]
        return [f"{self.inbox}/{entry}"]

    def _offer(self) -> None:
        self.counts.writes += 1
        self.client.create(f"{self.paths.offers}/{self.cid}", ephemeral=True)
        self.offered = True

    def step(self) -> bool:
        acker = self.acker
        while acker.done:
            self.seen.difference_update(acker.done.popleft())
        worked = False
        if self.tuning.inline:
            while self.bodies:
                entry, data = self.bodies.popleft()
                if entry.startswith("h-"):
                    self.offered = False   # a publisher took our offer
                acker.add(self._ack_paths(entry), self.held(data), entry)
                worked = True
            busy = bool(self.reading or self.bodies or self.batch)
            if acker.due(idle=not busy):
                acker.flush()
            if self.offers and not self.offered and not busy and not acker.unsettled:
                self._offer()
            return worked
        new: list[str] = []
        if self.relist:
            self.relist = False
            self.counts.reads += 1
            new = [e for e in self.client.get_children(self.inbox, watch=self._on_child_cb)
                   if e not in self.seen]
        while self.arrivals:
            entry = self.arrivals.popleft()
            if entry not in self.seen:
                new.append(entry)
        if new:
            self.seen.update(new)
            results = self.read_many([self._body_path(entry) for entry in new])
            for entry, result in zip(new, results):
                if isinstance(result, Exception):
                    self.report.errors.append(f"read of {entry} failed: {result!r}")
                    continue
                if entry.startswith("h-"):
                    self.offered = False   # a publisher took our offer
                acker.add(self._ack_paths(entry), self.held(result[0]), entry)
            worked = True
        if acker.due(idle=True):
            acker.flush()
        if self.offers and not self.offered and not self.seen:
            self._offer()
        return worked
