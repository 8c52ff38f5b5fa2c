"""The chord counter: how many header tasks of a chord have finished.

Celery's key/value chord protocol (``implements_incr``) asks the backend for
an atomic ``incr`` and fires the chord body when the count reaches the chord
size. A plain increment counts a header task twice when it runs twice (a
message redelivered after its worker died, with ``acks_late``), and then the
body fires before the last part is done. This counter counts *parts*: each
increment creates a child named after the header task id, in the same
transaction that bumps the count kept in the counter's data, so a part that
is already there is not counted again.
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

from .client import multi_failure
from .layout import Layout

__all__ = ["ChordCounter"]


class ChordCounter:
    """Counter node ``chords/{group id}``: data = count, children = counted parts."""

    def __init__(self, client: KazooClient, layout: Layout, group_id: str,
                 create: Callable[[], object] | None = None) -> None:
        self.client = client
        self.layout = layout
        self.path = layout.chord(group_id)
        self.group_id = group_id
        # Makes the counter node when missing (the backend also indexes it for
        # expiry); must treat NodeExists as success.
        self._create = create or self._create_plain

    def increment(self, part_id: str) -> int | None:
        """Count ``part_id``; the new count, or ``None`` if it was counted before."""
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

    def _create_plain(self) -> None:
        try:
            self.client.create(self.path, b"0", makepath=True)
        except NodeExistsError:
            pass

    def _inner_increment(self, part_id: str, token: str) -> int | None:
        part_path = self.layout.chord_part(self.group_id, part_id)
        try:
            data, stat = self.client.get(self.path)
        except NoNodeError:
            self._create()
            raise ForceRetryError() from None
        count = int(data or b"0") + 1
        # Without the transaction, a crash between making the part and bumping
        # the count would leave a part that is never counted: the chord hangs.
        tx = self.client.transaction()
        tx.create(part_path, f"{count}:{token}".encode())
        tx.set_data(self.path, str(count).encode(), version=stat.version)
        failure = multi_failure(tx.commit())
        if failure is None:
            return count
        error = failure[1]
        if isinstance(error, BadVersionError):
            raise ForceRetryError()  # another part was counted meanwhile
        if isinstance(error, NodeExistsError):
            return self._already_counted(part_path, token)
        if isinstance(error, NoNodeError):  # counter deleted: chord completed
            return None
        raise error

    def _already_counted(self, part_path: str, token: str) -> int | None:
        try:
            data, _ = self.client.get(part_path)
        except NoNodeError:  # counter deleted since: the chord completed
            return None
        counted, _, owner = data.decode().partition(":")
        return int(counted) if owner == token else None
