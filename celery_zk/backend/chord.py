"""The chord counter: how many header tasks of a chord have finished.

Celery's key/value chord protocol (``implements_incr``) asks the backend for
an atomic ``incr`` and fires the chord body when the count reaches the chord
size. A plain increment counts a header task twice when it runs twice (a
message redelivered after its worker died, with ``acks_late``), and then the
body fires before the last part is done. This counter counts *parts*: each
increment creates a child named after the header task id, in the same
transaction that bumps the count kept in the counter's data, so a part that
is already there is not counted again.

The number of parts the chord waits for, once Celery has said it
(``set_chord_size``), is kept in a child of its own, ``~size`` (a part's name
is an escaped task id, which never starts with ``~``). Celery's key/value
protocol otherwise takes the number of results in the saved header, which is
too small when the header nests groups (a chain ending in a group counts each
of that group's tasks): the body would fire before the last part, and the
last part would count "too many times".

A finished chord's counter is not deleted but *finished*: a ``~done`` child
is made and the counted parts are deleted. The counter then lives on as a
small tombstone, indexed for expiry like the results, so a header task
delivered again, or the whole chord applied again (a duplicated message
upstream of it), counts nothing and fires nothing: a chord's body fires once
per chord id. Deleting it, as Celery's protocol does, let a second run count
afresh and then find its saved header deleted by the first.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable

from kazoo.client import KazooClient
from kazoo.exceptions import (
    BadVersionError,
    NodeExistsError,
    NoNodeError,
)
from kazoo.retry import ForceRetryError

from ..zk.client import multi_failure
from ..zk.layout import CHORD_SIZE, Layout

__all__ = ["ChordCounter"]


class ChordCounter:
    """Counter node ``chords/{group id}``: data = count, children = counted parts
    (and ``~size``)."""

    def __init__(self, client: KazooClient, layout: Layout, group_id: str,
                 create: Callable[[], object] | None = None) -> None:
        self.client = client
        self.layout = layout
        self.path = layout.chord(group_id)
        self.size_path = layout.chord_size(group_id)
        self.done_path = layout.chord_done(group_id)
        self.group_id = group_id
        # Makes the counter node when missing (the backend also indexes it for
        # expiry); must treat NodeExists as success.
        self._create = create or self._create_plain

    def increment(self, part_id: str) -> tuple[int | None, int | None]:
        """Count ``part_id``: ``(new count or None if it was counted before, size)``,
        the size being what :meth:`set_size` stored (None if nothing was)."""
        # One token per call: a commit that succeeded just before a
        # ConnectionLoss is recognised as ours on the retry, not as a duplicate.
        token = uuid.uuid4().hex
        return self.client.retry(self._inner_increment, part_id, token)

    def value(self) -> int:
        try:
            data, _ = self.client.retry(self.client.get, self.path)
        except NoNodeError:
            return 0
        return int(data or b"0")

    def set_size(self, size: int) -> bool:
        """Record how many parts the chord waits for; False when there is no counter
        (an inner group's id, or a chord already finished)."""
        return bool(self.client.retry(self._inner_set_size, str(size).encode()))

    def _inner_set_size(self, size: bytes) -> bool:
        try:
            self.client.create(self.size_path, size)
        except NodeExistsError:   # the chord applied again (same id): a new run
            self.client.set(self.size_path, size)
        except NoNodeError:
            return False
        return True

    def _create_plain(self) -> None:
        try:
            self.client.create(self.path, b"0", makepath=True)
        except NodeExistsError:
            pass

    def finish(self) -> None:
        """The body was sent: keep the counter as a tombstone (``~done``) and drop
        the counted parts, so nothing counts again (see the module docstring)."""
        client = self.client
        try:
            client.retry(client.create, self.done_path)
        except NodeExistsError:
            pass
        except NoNodeError:
            return   # no counter (removed by expiry): nothing to keep
        parts = [name for name in client.retry(client.get_children, self.path)
                 if not name.startswith(CHORD_SIZE[0])]
        for result in [client.delete_async(self.layout.chord_child(self.group_id, name))
                       for name in parts]:
            try:
                result.get()
            except NoNodeError:
                pass

    def _inner_increment(self, part_id: str, token: str) -> tuple[int | None, int | None]:
        part_path = self.layout.chord_part(self.group_id, part_id)
        sized = self.client.get_async(self.size_path)   # the same round trip
        done = self.client.exists_async(self.done_path)
        try:
            data, stat = self.client.get(self.path)
        except NoNodeError:
            self._create()
            raise ForceRetryError() from None
        try:
            size: int | None = int(sized.get()[0])
        except NoNodeError:
            size = None
        if done.get() is not None:
            return None, size   # the chord finished: this is a duplicate
        count = int(data or b"0") + 1
        # Without the transaction, a crash between making the part and bumping
        # the count would leave a part that is never counted: the chord hangs.
        tx = self.client.transaction()
        tx.create(part_path, f"{count}:{token}".encode())
        tx.set_data(self.path, str(count).encode(), version=stat.version)
        failure = multi_failure(tx.commit())
        if failure is None:
            return count, size
        error = failure[1]
        if isinstance(error, BadVersionError):
            raise ForceRetryError()  # another part was counted meanwhile
        if isinstance(error, NodeExistsError):
            return self._already_counted(part_path, token), size
        if isinstance(error, NoNodeError):  # counter deleted: chord completed
            return None, size
        raise error

    def _already_counted(self, part_path: str, token: str) -> int | None:
        try:
            data, _ = self.client.get(part_path)
        except NoNodeError:  # counter deleted since: the chord completed
            return None
        counted, _, owner = data.decode().partition(":")
        return int(counted) if owner == token else None
