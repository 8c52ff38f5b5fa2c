"""The chord counter: how many header tasks of a chord have finished.

It counts *parts*, not increments: each header task that finishes creates a
child named after its task id in the transaction that bumps the count, so a
task run twice counts once. The chord waits for ``~size`` plus ``~added``
parts; a part's name is an escaped task id, which never starts with ``~``.
Each apply of a chord is a run of its own, and a finished run stays a
tombstone (``~done``); a generator's header is marked ``~lazy``. See
``docs/backend.md``, "Chords".
"""
from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import (
    BadVersionError,
    NodeExistsError,
    NoNodeError,
)
from kazoo.retry import ForceRetryError

from ..zk.client import FAILOVER_PATIENCE, answered, connected_retry, multi_failure
from ..zk.layout import Layout
from ..zk.names import OWNER_SEP, unescape

__all__ = ["ChordCounter", "Count"]

#: Most deletes in one multi when a counter is reset for a new run.
RESET_BATCH = 500

T = TypeVar("T")


class Count(NamedTuple):
    """What counting one part found."""

    #: The new count; None when the part was counted before (or the run finished).
    counted: int | None
    #: How many parts the run waits for; None until ``set_chord_size`` said it.
    size: int | None
    #: The header was a generator (see the module docstring).
    lazy: bool
    #: Counted before, and every part is counted but the body was never sent:
    #: the worker that counted the last part stopped before sending it.
    stalled: bool = False


class ChordCounter:
    """Counter node ``chords/{group id}``: data = count, children = counted parts
    (and ``~size``, ``~added``, ``~lazy``, ``~done``)."""

    def __init__(self, client: KazooClient, layout: Layout, group_id: str,
                 create: Callable[[], object] | None = None) -> None:
        self.client = client
        self.layout = layout
        self.path = layout.chord(group_id)
        self.size_path = layout.chord_size(group_id)
        self.added_path = layout.chord_added(group_id)
        self.lazy_path = layout.chord_lazy(group_id)
        self.done_path = layout.chord_done(group_id)
        self.sent_path = layout.chord_sent(group_id)
        self.group_id = group_id
        # Makes the counter node when missing (the backend also indexes it for
        # expiry); must treat NodeExists as success.
        self._create = create or self._create_plain

    def _retry(self, func: Callable[..., T], *args: Any) -> T:
        # Rides out a leader failover, as a result write does: the last part's
        # count and the run's end are made by a task whose message is acked
        # whether they land or not (a chord failed or stalled for good).
        return connected_retry(self.client, func, *args, patience=FAILOVER_PATIENCE)

    # -- a run ------------------------------------------------------------------
    def start(self, lazy: bool, fresh: bool) -> None:
        """A new run of the chord: the count back to 0 and what an earlier run
        of this group id left (its size, parts, tombstone) gone, unless the
        counter is ``fresh`` (just made). ``lazy``: the header is a generator."""
        self._retry(self._inner_start, lazy, fresh)

    def _inner_start(self, lazy: bool, fresh: bool) -> None:
        client = self.client
        if not fresh:
            children = [self.layout.chord_child(self.group_id, name)
                        for name in client.get_children(self.path)]
            for first in range(0, len(children), RESET_BATCH):
                tx = client.transaction()
                for child in children[first:first + RESET_BATCH]:
                    tx.delete(child)
                failure = multi_failure(tx.commit())
                if failure is not None and not isinstance(failure[1], NoNodeError):
                    raise failure[1]
                if failure is not None:
                    raise ForceRetryError()   # one went meanwhile: list again
        # One multi: the run begins with its count at 0 and its kind known.
        tx = client.transaction()
        tx.set_data(self.path, b"0")
        if lazy:
            tx.create(self.lazy_path)
        failure = multi_failure(tx.commit())
        if failure is None:
            return
        if isinstance(failure[1], NodeExistsError):   # a retry after a lost reply
            return
        if isinstance(failure[1], NoNodeError):
            self._create()
            raise ForceRetryError()
        raise failure[1]

    def increment(self, part_id: str, group_index: int | None = None,
                  also: Callable[[TransactionRequest, bool], None] | None = None) -> Count:
        """Count ``part_id`` (the ``group_index``-th task of the header).
        ``also(tx, last)`` adds its own operations to the multi that counts it;
        ``last``: this part completes the count."""
        # One token per call: a commit that succeeded just before a
        # ConnectionLoss is recognised as ours on the retry, not as a duplicate.
        token = uuid.uuid4().hex
        return self._retry(self._inner_increment, part_id, token,
                                 "" if group_index is None else str(group_index), also)

    def set_size(self, size: int) -> bool:
        """Record how many parts the chord waits for; False when there is no counter
        (an inner group's id, or a chord already finished)."""
        return bool(self._retry(self._inner_set_size, str(size).encode()))

    def _inner_set_size(self, size: bytes) -> bool:
        try:
            self.client.create(self.size_path, size)
        except NodeExistsError:
            self.client.set(self.size_path, size)
        except NoNodeError:
            return False
        return True

    def add(self, also: Callable[[Any], None] | None = None) -> None:
        """One more part to wait for (``Task.add_to_chord``). ``also(tx)`` adds
        its own operations to the same transaction (the saved group's new
        member); a conflict it causes makes the whole add retry."""
        self._retry(self._inner_add, also)

    def _inner_add(self, also: Callable[[Any], None] | None) -> None:
        client = self.client
        try:
            data, stat = client.get(self.added_path)
        except NoNodeError:
            data, stat = None, None
        tx = client.transaction()
        if stat is None:
            tx.create(self.added_path, b"1")
        else:
            tx.set_data(self.added_path, str(int(data or b"0") + 1).encode(),
                        version=stat.version)
        if also is not None:
            also(tx)
        failure = multi_failure(tx.commit())
        if failure is None:
            return
        if isinstance(failure[1], (BadVersionError, NodeExistsError)):
            raise ForceRetryError()   # another add (or the group changed) meanwhile
        if isinstance(failure[1], NoNodeError):
            raise LookupError(
                f"chord {self.group_id} has no counter: it was never applied, or it "
                "finished and expired. add_to_chord works from a header task of a "
                "chord still running.")
        raise failure[1]

    def parts(self) -> list[str]:
        """The counted parts' task ids in header order (Celery's ``group_index``,
        then the order they were counted)."""
        return self._retry(self._inner_parts)

    def _inner_parts(self) -> list[str]:
        client = self.client
        names = [name for name in client.get_children(self.path)
                 if not name.startswith(OWNER_SEP)]
        reads = [(name, client.get_async(self.layout.chord_child(self.group_id, name)))
                 for name in names]
        keyed = []
        for name, (data, _) in answered(reads):
            count, _, index = _parse_part(data)
            keyed.append(((math.inf if index is None else index, count), unescape(name)))
        return [task_id for _, task_id in sorted(keyed)]

    def _create_plain(self) -> None:
        try:
            self.client.create(self.path, b"0", makepath=True)
        except NodeExistsError:
            pass

    def sent(self) -> bool:
        """Whether this run's body was published (``~sent``, made by the publish's
        own multi on a zk:// broker: see celery_zk.backend.chord_body)."""
        return self._retry(self.client.exists, self.sent_path) is not None

    def finish(self, also: Callable[[TransactionRequest], None] | None = None) -> None:
        """The body was sent: keep the counter as a tombstone (``~done``) and drop
        the counted parts, so nothing counts again (see the module docstring).
        ``also(tx)`` adds its own operations to the multi that makes ``~done``."""
        try:
            self._retry(self._inner_finish, also)
        except NodeExistsError:
            pass
        except NoNodeError:
            return   # no counter (removed by expiry): nothing to keep
        self._retry(self._drop_parts)

    def _drop_parts(self) -> None:
        client = self.client
        try:
            names = client.get_children(self.path)
        except NoNodeError:
            return   # removed by expiry meanwhile
        parts = [name for name in names if not name.startswith(OWNER_SEP)]
        for result in [client.delete_async(self.layout.chord_child(self.group_id, name))
                       for name in parts]:
            try:
                result.get()
            except NoNodeError:
                pass

    def _inner_finish(self, also: Callable[[TransactionRequest], None] | None) -> None:
        tx = self.client.transaction()
        tx.create(self.done_path)
        if also is not None:
            also(tx)
        failure = multi_failure(tx.commit())
        if failure is None:
            return
        index, error = failure
        if index > 0 and isinstance(error, (NoNodeError, BadVersionError)):
            # What ``also`` changes went meanwhile: the tombstone is what matters.
            self.client.create(self.done_path)
            return
        if index == 0 and isinstance(error, NodeExistsError) and also is not None:
            # Finished already (a lost reply, or a part run again sent it too):
            # what ``also`` does must still be done.
            tx = self.client.transaction()
            also(tx)
            tx.commit()   # a failure here means it changed meanwhile: left as it is
        raise error

    def _inner_increment(self, part_id: str, token: str, group_index: str,
                         also: Callable[[TransactionRequest, bool], None] | None = None
                         ) -> Count:
        part_path = self.layout.chord_part(self.group_id, part_id)
        client = self.client
        # The same round trip as the count: what the run waits for, and its kind.
        sized = client.get_async(self.size_path)
        added = client.get_async(self.added_path)
        lazy_read = client.exists_async(self.lazy_path)
        done = client.exists_async(self.done_path)
        try:
            data, stat = client.get(self.path)
        except NoNodeError:
            self._create()
            raise ForceRetryError() from None
        size = _int_or_none(sized)
        if size is not None:
            size += _int_or_none(added) or 0
        lazy = lazy_read.get() is not None
        if done.get() is not None:
            return Count(None, size, lazy)   # the run finished: this is a duplicate
        count = int(data or b"0") + 1
        # Without the transaction, a crash between making the part and bumping
        # the count would leave a part that is never counted: the chord hangs.
        tx = client.transaction()
        tx.create(part_path, f"{count}:{token}:{group_index}".encode())
        tx.set_data(self.path, str(count).encode(), version=stat.version)
        if also is not None:
            also(tx, size is not None and count == size)
        failure = multi_failure(tx.commit())
        if failure is None:
            return Count(count, size, lazy)
        error = failure[1]
        if failure[0] > 1:   # what ``also`` changes went meanwhile (a forgotten result)
            return self._inner_increment(part_id, token, group_index, None)
        if isinstance(error, BadVersionError):
            raise ForceRetryError()  # another part was counted meanwhile
        if isinstance(error, NodeExistsError):
            counted = self._already_counted(part_path, token)
            # A part run again (its message redelivered): if the count is
            # complete, the run is not done yet (~done was absent above) and its
            # body may never have been sent; sending falls to this part.
            stalled = counted is None and size is not None and count - 1 >= size
            return Count(counted, size, lazy, stalled)
        if isinstance(error, NoNodeError):  # counter deleted: chord completed
            return Count(None, size, lazy)
        raise error

    def _already_counted(self, part_path: str, token: str) -> int | None:
        try:
            data, _ = self.client.get(part_path)
        except NoNodeError:  # counter deleted since: the chord completed
            return None
        counted, owner, _ = _parse_part(data)
        return counted if owner == token else None


def _parse_part(data: bytes) -> tuple[int, str, int | None]:
    """A part's ``(count, token, group index)``; parts stored before the index
    was kept have none."""
    count, _, rest = data.decode().partition(":")
    token, _, index = rest.partition(":")
    return int(count), token, int(index) if index else None


def _int_or_none(read: Any) -> int | None:
    try:
        data, _ = read.get()
    except NoNodeError:
        return None
    return int(data or b"0")
