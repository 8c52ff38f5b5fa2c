"""One consumer's offer on one queue (the consumer's side of the hand-off,
:mod:`celery_zk.broker.handoff`), and when to make and withdraw it.

The token is read and swapped under a lock by the consuming thread (making,
withdrawing) and by kazoo's thread (a create that failed), so an offer is
never deleted twice (a failed delete is still a logged transaction). See
``docs/design.md``, "Hand-off".
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..zk.client import CONNECTION_ERRORS, log_failure
from ..zk.names import OFFER_TAKES_BODY
from .handoff import HandOff
from .publish import new_uid

__all__ = ["Offer"]

logger = logging.getLogger(__name__)

#: Seconds after which an idle consumer whose worker still runs tasks looks
#: again whether it may make an offer, doubled while they run, up to the second.
LOOK_AGAIN = (0.005, 1.0)
#: Seconds a consumer keeps its offer while every pool slot is taken by what
#: publishers handed over (a burst of a trickle, not a backlog).
BUSY_GRACE = 0.02


class Offer:
    """One consumer's offer on one queue: at most one outstanding at a time."""

    def __init__(self, handoff: HandOff, queue: str,
                 look_again: Callable[[float], Any]) -> None:
        self.handoff = handoff
        self.queue = queue
        #: ``look_again(delay)``: the event loop's timer that wakes the consumer
        #: (``cancel()`` stops it), or None without an event loop.
        self._look_again_timer = look_again
        self.token: str | None = None
        self.consumer_id: str | None = None
        self._sent: str | None = None   # the token whose create went out
        self._lock = threading.Lock()
        self._look_in = LOOK_AGAIN[0]   # the next look-again's delay
        self._look_at = 0.0             # when the one asked for is due
        self._look_timer: Any = None    # and its timer, cancelled by a delivery
        self._busy_since: float | None = None   # every pool slot taken since

    @property
    def outstanding(self) -> bool:
        return self.token is not None

    # -- when -------------------------------------------------------------------
    def dry(self, consumer_id: str, in_hand: int, slots: int, may: bool) -> None:
        """Nothing to deliver: offer if a pool slot is free (``may``: consuming,
        fewer delivered than slots, the inbox watched); else look again when
        that may have changed."""
        if in_hand < slots:
            self._busy_since = None
        elif self.outstanding:
            self._withdraw_when_busy()   # every slot taken: a handed message would wait
        if not may or self.outstanding:
            return
        if in_hand >= slots:
            self._look_again()
            return
        self._look_in = LOOK_AGAIN[0]
        self.make(consumer_id)   # a free slot: let a publisher hand us the next one

    def given(self, handed: bool, busy: bool) -> None:
        """Work arrived (``handed``: by a publisher), and takes every slot (``busy``)."""
        if not busy:
            self._busy_since = None
        elif self.outstanding:
            # Work from the dispatcher says the queue has a backlog: withdraw
            # now, and offer later. (Sent after the reads of that work: the
            # server answers a session's requests in order, and a delete is a
            # synced write.)
            if handed:
                self._withdraw_when_busy()
            else:
                self.withdraw(wait=False)

    def delivering(self) -> None:
        """A message is delivered: busy again, no look needed."""
        self._look_in = LOOK_AGAIN[0]
        if self._look_timer is not None:
            self._look_timer.cancel()
            self._look_timer, self._look_at = None, 0.0

    def _look_again(self) -> None:
        """Come back while our worker still runs tasks we delivered (acked as
        they started), after a delay doubled each time: nothing else tells us
        when they are done. Nothing without an event loop."""
        now = time.monotonic()
        if now < self._look_at:
            return   # asked for already
        delay = self._look_in
        self._look_in = min(self._look_in * 2, LOOK_AGAIN[1])
        timer = self._look_again_timer(delay)
        if timer is not None:
            self._look_timer, self._look_at = timer, now + delay

    def _withdraw_when_busy(self) -> None:
        """Every slot is taken by handed work: withdraw once that has lasted
        BUSY_GRACE s (looking again then, in an event loop)."""
        now = time.monotonic()
        if self._busy_since is None:
            self._busy_since = now
        left = self._busy_since + BUSY_GRACE - now
        if left <= 0:
            self.withdraw(wait=False)
            return
        if self._look_timer is not None and self._look_at <= now + left:
            return   # a look is due by then
        timer = self._look_again_timer(left)
        if timer is None:   # no event loop to come back to us: now
            self.withdraw(wait=False)
            return
        if self._look_timer is not None:   # due later: this look does its work too
            self._look_timer.cancel()
        self._look_timer, self._look_at = timer, now + left

    # -- the offer node ---------------------------------------------------------
    def make(self, consumer_id: str) -> None:
        """Offer to take messages, with their bodies in their names."""
        token = new_uid() + OFFER_TAKES_BODY
        with self._lock:
            if self.token is not None:
                return   # made meanwhile (an ack's thread, the consuming one)
            self.token, self.consumer_id = token, consumer_id

        def still_wanted(send: Callable[[], None]) -> bool:
            # Under the lock: a withdrawal clears the token first, so its delete
            # can never be sent before this create.
            with self._lock:
                if self.token != token:
                    return False
                send()
                self._sent = token
                return True

        def failed() -> None:   # kazoo's thread: the create failed (no queue)
            with self._lock:
                if self.token != token:
                    return   # withdrawn by us
                self.token = None
            self.handoff.taken(self.queue, consumer_id, token)

        self.handoff.make_offer(self.queue, consumer_id, token, still_wanted, failed)

    def withdraw(self, wait: bool = True) -> None:
        """Withdraw the outstanding offer (``wait``: until the server has deleted
        it, when we stop: nothing may be handed to us after that; else the
        delete is only sent). A delete that fails is redone in the background."""
        with self._lock:
            token, consumer_id = self.token, self.consumer_id
            sent, self.token = self._sent == token, None
        if token is None or consumer_id is None:
            return
        if not sent:   # still held back: never sent now (see make), nothing to delete
            self.handoff.taken(self.queue, consumer_id, token)
            return
        if not wait:
            self.handoff.withdraw_async(self.queue, consumer_id, token)
            return
        try:
            self.handoff.withdraw(self.queue, consumer_id, token)
        except CONNECTION_ERRORS as exc:
            self.handoff.withdraw_later(self.queue, consumer_id, token)
            log_failure(logger, exc, "celery_zk: could not withdraw the offer on %s now; "
                        "retrying in the background", self.queue)
