"""Which waiting messages go to which consumer, and the multi that gives them.

A :class:`Planner` chooses from the queue's :class:`Head` for the consumers
with free credit (one message at a time around them, by affinity key, or
held back by a limit), and :func:`assignment` builds the one multi that gives
the plan. In it each consumer's part is guarded by a check of its node under
``consumers/``, and each name is deleted from its bucket as it is created in
the inbox: so nothing goes to a consumer that is gone, and a message is
given once even when two dispatchers overlap. See ``docs/design.md``, "One
dispatcher per queue".
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from ..features.affinity import Board, board_for
from ..features.limit_gate import Gate
from ..features.limits import LimitStore, book_for
from ..features.locality import Waiting, choose
from ..zk.client import multi_failure
from ..zk.config import ZKOptions
from ..zk.layout import Layout
from ..zk.message_names import MessageName, order_key, parse_message_name, slot_of
from ..zk.multi import Multi
from ..zk.session import SharedSession
from .queues import ANY_VERSION, OP_OVERHEAD, REQUEST_BUDGET

__all__ = ["Assignment", "Consumer", "Head", "Planner", "assignment", "settle"]

#: Most operations in one assignment multi (each a path of ~150 bytes at most:
#: far below jute.maxbuffer).
ASSIGN_OPS = 1000


@dataclass
class Consumer:
    """What the dispatcher knows of one consumer of its queue."""

    id: str
    node: str = ""   # its node's name under the queue's consumers/ (the multi checks it)
    credit: int = 0
    worker: str | None = None
    entries: set[str] = field(default_factory=set)   # names in its inbox
    given: set[str] = field(default_factory=set)     # given by us, not yet seen there
    listed: bool = False    # its inbox was listed since we (re)started watching
    waiting: Waiting = field(default_factory=Waiting)   # its affinity memory

    @property
    def free(self) -> int:
        return self.credit - len(self.entries | self.given)


class Head:
    """The first waiting messages of the queue in delivery order, as listed and
    then kept up to date by the watch on ``unowned/``. Sorted lists with
    binary search: a busy queue's head changes on every publish and give."""

    def __init__(self) -> None:
        self.keys: list[tuple[Any, ...]] = []
        self.names: list[str] = []
        self.complete = False   # every waiting message is here (the listing ended)
        self.keyed = 0          # how many carry an affinity key

    def reset(self, names: list[str], complete: bool) -> None:
        keys = []
        keyed = 0
        for name in names:
            key = order_key(name)
            if key is not None:
                keys.append(key)
                keyed += bool(parse_message_name(name).affinity)  # type: ignore[union-attr]
        self.keys = keys
        self.names = [name for _, name in keys]
        self.complete = complete
        self.keyed = keyed

    def add(self, name: str, message: MessageName) -> None:
        key = order_key(name)   # the name breaks ties (requeued hand-offs)
        assert key is not None
        if not self.complete and (not self.keys or key > self.keys[-1]):
            return   # beyond what we listed: the next listing finds it
        index = bisect.bisect_left(self.keys, key)
        if index < len(self.names) and self.names[index] == name:
            return
        self.keys.insert(index, key)
        self.names.insert(index, name)
        self.keyed += bool(message.affinity)

    def discard(self, names: Iterable[str]) -> None:
        names = list(names)
        count = len(names)
        if count > 1 and set(self.names[:count]) == set(names):
            # What a plan gives from a backlog: the head's first names, cut off
            # at once (one by one, each cut moved the rest of a bucket's names).
            for name in self.names[:count]:
                self.keyed -= bool(parse_message_name(name).affinity)  # type: ignore[union-attr]
            del self.keys[:count], self.names[:count]
            return
        for name in names:
            key = order_key(name)
            if key is None:
                continue
            index = bisect.bisect_left(self.keys, key)
            if index < len(self.names) and self.names[index] == name:
                del self.keys[index]
                del self.names[index]
                self.keyed -= bool(parse_message_name(name).affinity)  # type: ignore[union-attr]


class Planner:
    """The choice of one queue's dispatcher: which names go to which consumer."""

    def __init__(self, session: SharedSession, layout: Layout, options: ZKOptions,
                 queue: str, wake: Callable[[], None]) -> None:
        self.session = session
        self.layout = layout
        self.options = options
        self.queue = queue
        self._wake = wake   # a limit changed at run time: look again
        self._rotation = 0
        self._gate: Gate | None = None
        self._given: dict[tuple[str, str], list[float]] = {}   # rate limits' give times

    def forget(self) -> None:
        """Read the give times again: another dispatcher may have given meanwhile."""
        self._given.clear()

    def plan(self, head: Head, consumers: dict[str, Consumer], hungry: list[Consumer],
             live: list[str]) -> tuple[dict[str, list[str]], float | None]:
        """Which names go to which consumer, in delivery order; and seconds until
        a look is due by itself (a keyed message may go elsewhere, a limit
        admits more), or None."""
        self._gate = self._limits(consumers)
        if head.keyed:
            return self._plan_keyed(head, hungry, live)
        names: Iterable[str] = head.names
        if self._gate is not None:
            names = self._admitted(head, self._gate)
        # One at a time, round the consumers: the first messages go to as many
        # consumers as there are, not all to the first.
        self._rotation = (self._rotation + 1) % len(hungry)
        order = hungry[self._rotation:] + hungry[:self._rotation]
        room = {c.id: c.free for c in order}
        plan: dict[str, list[str]] = {}
        waiting = iter(names)
        while any(room.values()):
            for consumer in order:
                if room[consumer.id] <= 0:
                    continue
                name = next(waiting, None)
                if name is None:
                    return plan, self._retry_in()
                plan.setdefault(consumer.id, []).append(name)
                room[consumer.id] -= 1
        return plan, self._retry_in()

    # -- limits (celery_zk.features.limits) ------------------------------------------
    def _limits(self, consumers: dict[str, Consumer]) -> Gate | None:
        """This round's gate, when a limit applies to the queue."""
        book = book_for(self.session, self.layout)
        book.listen(self._wake)
        limits = book.current()
        if not limits:
            return None
        # Given and not acked, and acked early but running still (their slots).
        owned = [m for c in consumers.values() for n in (c.entries | c.given)
                 if (m := parse_message_name(n) or slot_of(n)) is not None]
        store = LimitStore(self.session.client, self.layout)
        for limit in limits:
            ident = (limit.kind, limit.name)
            if limit.rate and ident not in self._given:
                self._given[ident] = store.given(limit)   # a dispatcher taking over
        gate = Gate(limits, self.queue, owned, self._given)
        return gate if gate.active else None

    @staticmethod
    def _admitted(head: Head, gate: Gate) -> Iterator[str]:
        """The head in order, but what a limit holds back now."""
        for name in list(head.names):
            message = parse_message_name(name)
            if message is not None and gate.admit(message):
                yield name

    def _retry_in(self) -> float | None:
        return self._gate.retry_in if self._gate is not None else None

    def records(self) -> list[tuple[Any, list[float]]]:
        """The give times of the rate limits this round's plan uses, to write
        in the multi that gives it (a dispatcher taking over sees them)."""
        return list(self._gate.records()) if self._gate is not None else []

    def given(self, records: list[tuple[Any, list[float]]]) -> None:
        """The multi with ``records`` committed."""
        for limit, times in records:
            self._given[(limit.kind, limit.name)] = times

    def make_given_record(self, kind: str, name: str) -> None:
        """A limit's record of give times is missing (its multi was refused)."""
        client = self.session.client
        try:
            client.retry(client.create, self.layout.limit_given(kind, name), b"[]")
        except NodeExistsError:
            pass
        except NoNodeError:   # the limit was cleared meanwhile: the book reloads
            self._given.pop((kind, name), None)

    def _plan_keyed(self, head: Head, hungry: list[Consumer],
                    live: list[str]) -> tuple[dict[str, list[str]], float | None]:
        board = self._board()
        # Admitted up front: what a consumer's choice leaves out still counts, so
        # a limit may give a little less this round, never more.
        left = (list(self._admitted(head, self._gate)) if self._gate is not None
                else list(head.names))
        plan: dict[str, list[str]] = {}
        retry_in: float | None = None
        for consumer in hungry:
            view = board.seen_by(consumer.worker)
            index = live.index(consumer.id) if consumer.id in live else 0
            idle = not (consumer.entries or consumer.given)
            batch, due = choose(left, consumer.free, view, consumer.waiting,
                                self.options.locality_wait, index=index, idle=idle)
            if due is not None and (retry_in is None or due < retry_in):
                retry_in = due
            if batch:
                plan[consumer.id] = batch
                chosen = set(batch)
                left = [name for name in left if name not in chosen]
        gated = self._retry_in()
        if gated is not None and (retry_in is None or gated < retry_in):
            retry_in = gated
        return plan, retry_in

    def _board(self) -> Board:
        board = board_for(self.session, self.layout)
        board.refresh()
        return board


@dataclass
class Assignment:
    """One multi's worth of names for consumers, as built by :meth:`Claiming.assignment`."""

    queue: str
    ops: list[tuple[str, str, str]] = field(default_factory=list)   # (kind, consumer, name)
    size: int = 0

    def given(self) -> dict[str, list[str]]:
        """Consumer id -> the names given to it."""
        given: dict[str, list[str]] = {}
        for kind, consumer, name in self.ops:
            if kind == "create":
                given.setdefault(consumer, []).append(name)
        return given


def assignment(client: KazooClient, layout: Layout, queue: str, plan: dict[str, list[str]],
           nodes: dict[str, str]) -> tuple[Multi, Assignment]:
    """The multi that gives each consumer of ``plan`` its names; ``nodes``:
    each one's node under the queue's consumers/, which the multi checks.
    Stops adding consumers before :data:`ASSIGN_OPS` operations or
    :data:`REQUEST_BUDGET` bytes.
    """
    txn = Multi(client)   # the hot multi: serialized in one pass
    done = Assignment(queue)
    budget = REQUEST_BUDGET
    for consumer, names in plan.items():
        ops = 1 + 2 * len(names)
        size = sum(2 * len(name) + OP_OVERHEAD for name in names)
        if done.ops and (len(done.ops) + ops > ASSIGN_OPS or done.size + size > budget):
            break
        txn.check(layout.queue_consumer(queue, nodes[consumer]), ANY_VERSION)
        done.ops.append(("check", consumer, ""))
        for name in names:
            # Without the multi a crash between the two would lose the
            # message (deleted, never given) or give it twice.
            txn.delete(layout.unowned_message(queue, name))
            txn.create(layout.inbox_message(queue, consumer, name))
            done.ops += [("delete", consumer, name), ("create", consumer, name)]
        done.size += size
    return txn, done

def settle(done: Assignment, results: list[Any]) -> tuple[str, str, str] | None:
    """None when the assignment committed, else the operation that refused it
    (``(kind, consumer, name)``): its consumer or message is gone."""
    failure = multi_failure(results)
    if failure is None:
        return None
    index, error = failure
    if not isinstance(error, (NoNodeError, NodeExistsError, BadVersionError)):
        raise error
    return done.ops[index]
