"""The transport as its channels and queue views use it.

:class:`~celery_zk.broker.transport.Transport` makes the channels
(:mod:`.channel`), which consume through inboxes (:mod:`.inbox`); they see
it through this protocol, so neither imports the module that imports them.
"""
from __future__ import annotations

from typing import Any, Protocol

from ..features.affinity import Board
from ..zk.config import ZKSettings
from ..zk.layout import Layout
from ..zk.session import ClientHandle
from ..zk.watches import TreeWatches
from .acks import Acks
from .autodelete import AutoDeleteQueues
from .bindings import Bindings
from .budget import Budget
from .handoff import HandOff
from .liveness import ConsumerSession
from .publish import NewMessage, Publisher
from .queue_limits import QueueLimits
from .queues import Queues
from .unconfirmed import UnconfirmedPublisher

__all__ = ["ZKConnection"]


class ZKConnection(Protocol):
    """One ``zk://`` connection: its session, queues and wake-up."""

    settings: ZKSettings
    layout: Layout
    handle: ClientHandle
    queues: Queues
    publisher: Publisher
    budget: Budget
    queue_limits: QueueLimits
    acks: Acks
    session: ConsumerSession
    bindings: Bindings
    auto_delete: AutoDeleteQueues
    handoff: HandOff | None
    unconfirmed: UnconfirmedPublisher | None
    declared_queues: set[str]

    @property
    def watches(self) -> TreeWatches: ...

    @property
    def affinity(self) -> Board: ...

    def wake(self) -> None:
        """Something may be deliverable now."""

    @property
    def in_event_loop(self) -> bool:
        """Whether Celery's event loop drives it (else a blocking drain_events)."""

    def look_again(self, delay: float) -> Any:
        """Wake in ``delay`` s, if an event loop can: its timer, else None."""

    def inbox(self, queue: str) -> Any:
        """This connection's inbox on ``queue`` (:class:`celery_zk.broker.inbox.Inbox`)."""

    def settled(self, delivery_tag: str) -> None:
        """A delivered message was acked, rejected or requeued."""

    def publishing_together(self) -> list[NewMessage] | None: ...

    def prepare_worker(self) -> None: ...

    def limited(self, queue: str, task: str | None) -> bool: ...

    def limits(self) -> list[Any]: ...

    def consuming_changed(self) -> None: ...
