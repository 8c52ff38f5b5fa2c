"""Hand-off, the publisher's side: a message goes straight into the inbox of
a consumer that left an offer, in one multi that checks the offer.

That check is the safety: it proves the owner's session alive as the
message becomes owned, so nothing is handed over without it. Publishers
check offers and leave them (they stand); a stale cache costs a refused
multi, and the message is then published as usual. Watch callbacks run on
kazoo's thread: never block. See ``docs/design.md``, "Hand-off".
"""
from __future__ import annotations

import functools
import logging
import random
import threading
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError

from ..zk.client import (
    RedoThread,
    connected_retry,
    delete_if_there,
    log_failure,
    multi_failure,
    synced,
)
from ..zk.layout import Layout
from ..zk.message_names import BODY_APART, encode_body, handed_name
from ..zk.names import OFFER_TAKES_BODY, offer_name, parse_offer_name
from ..zk.session import ClientHandle, weak_callback
from .publish import NewMessage
from .queues import Queues

logger = logging.getLogger(__name__)

__all__ = ["HandOff"]


class HandOff:
    """The hand-off requests of one connection, and its publishers' view of the offers."""

    def __init__(self, handle: ClientHandle, layout: Layout, queues: Queues) -> None:
        self.handle = handle
        self.layout = layout
        self.queues = queues
        self._client: KazooClient | None = None
        # queue -> offer names, kept current by a child watch per queue. Replaced,
        # never mutated: read by publishing threads, written by kazoo's thread.
        self._offers: dict[str, tuple[str, ...]] = {}
        self._watchers: dict[str, Callable[[Any], None]] = {}
        # queue -> (unowned path, watched) of this process's last message of it put
        # in line, while it may still wait there (see give)
        self._line: dict[str, tuple[str, bool]] = {}
        self._lock = threading.Lock()
        self._withdrawals: RedoThread[tuple[str, str, str]] = RedoThread(
            "celery_zk-withdraw", self._withdraw_again)

    @property
    def client(self) -> KazooClient:
        client = self.handle.client
        if client is not self._client:   # first use, or a new client after fork
            with self._lock:
                if client is not self._client:
                    self._offers, self._watchers = {}, {}
                    self._client = client
        return client

    # -- publishing -------------------------------------------------------------
    def give(self, message: NewMessage) -> bool:
        """Hand ``message`` to an idle consumer of its queue; False when none took it
        (the caller then publishes it to wait for the dispatcher, and says so:
        :meth:`in_line`)."""
        queue = message.queue
        offers = self._known_offers(queue)
        if not offers or not self._line_left(queue):
            return False
        offer = random.choice(offers)   # spread over the consumers offering
        if self._hand_off(message, offer):
            return True
        self._forget(queue, offer)   # withdrawn meanwhile
        return False

    def in_line(self, queue: str, name: str) -> None:
        """Our message ``name`` went to wait in line. Until it has left
        ``unowned/`` (given to a consumer, or purged) no message of the queue is
        handed over: handed at once, the next could reach a consumer before
        the dispatcher gives it this one. One publisher's messages keep their
        order."""
        self._line[queue] = (self.layout.unowned_message(queue, name), False)

    def _line_left(self, queue: str) -> bool:
        """Whether our last message put in line has left it. Looked at (with a
        watch for when it goes) the first time an offer is known after it
        went in line, so a publisher in a backlog, where nobody offers,
        pays nothing for it; once watched, the watch says."""
        entry = self._line.get(queue)
        if entry is None:
            return True
        path, watched = entry
        if watched:
            return False

        def left(event: Any) -> None:   # kazoo's thread: given, purged, or the
            # connection dropped (its watches with it: order is best effort then)
            with self._lock:
                if self._line.get(queue, ("",))[0] == path:
                    del self._line[queue]

        self._line[queue] = (path, True)
        try:   # a get, not an exists: on a node gone already it leaves no watch
            self.client.retry(self.client.get, path, watch=left)
        except NoNodeError:
            left(None)
        return queue not in self._line

    def _hand_off(self, message: NewMessage, offer: str) -> bool:
        parsed = parse_offer_name(offer)
        if parsed is None:
            return False
        layout, client, queue = self.layout, self.client, message.queue
        consumer_id, token = parsed
        body = (encode_body(message.data)
                if token.endswith(OFFER_TAKES_BODY) and message.kind == BODY_APART else None)
        name = handed_name(message.inverted_priority, message.generation, message.uid,
                           message.kind, message.task, message.limit_key, body, message.size)
        owned = layout.inbox_message(queue, consumer_id, name)

        maybe_made = False   # an attempt whose reply was lost may have stored it

        def attempt() -> bool:
            nonlocal maybe_made
            if maybe_made:
                # Looked at before anything is stored again, on every retry: a
                # look made while the connection was still down failed too, and
                # the retry that follows must not skip it (the nemesis saw a
                # message handed twice, unsaid). An ack deletes the body with
                # the name; the body there says it was stored (delivered, or
                # given back to the queue since).
                synced(client, message.body_path)   # else a lagging server may not know it yet
                if client.retry(client.exists, message.body_path) is not None:
                    return True   # it committed; only the reply was lost
                logger.warning(   # said before whatever makes it again
                    "celery_zk: the reply to a hand-off was lost and message %s is not "
                    "stored; handing or publishing it again (had it been stored and already "
                    "acked, it runs twice: at-least-once)", message.uid)
            txn = client.transaction()
            # The offer's check proves its owner's session alive at this instant
            # (an ephemeral node). It stands: the consumer withdraws it when its
            # pool's slots are taken, so one offer takes every message of a trickle.
            txn.check(layout.offer(queue, offer), -1)
            txn.create(message.body_path, message.data)
            txn.create(owned)
            maybe_made = True
            results = txn.commit()
            maybe_made = False
            failure = multi_failure(results)
            if failure is None:
                return True
            if isinstance(failure[1], (NoNodeError, NodeExistsError)):
                # The offer was taken or withdrawn, its consumer's inbox is gone,
                # or the body's bucket is: publish it as usual.
                return False
            raise failure[1]

        return bool(connected_retry(client, attempt))   # a publish: see connected_retry

    def _known_offers(self, queue: str) -> tuple[str, ...]:
        client = self.client
        offers = self._offers.get(queue)
        if offers is None:
            offers = self._list(client, queue)
        return offers

    def _list(self, client: KazooClient, queue: str) -> tuple[str, ...]:
        """Read ``queue``'s offers and watch them (an exists watch while there is no
        directory: the queue is not declared yet)."""
        path, watcher = self.layout.offers(queue), self._watcher(queue)
        try:
            names = tuple(client.retry(client.get_children, path, watch=watcher))
        except NoNodeError:
            if client.retry(client.exists, path, watch=watcher) is not None:
                return self._list(client, queue)   # created meanwhile
            names = ()
        self._store(queue, names)
        return names

    def _watcher(self, queue: str) -> Callable[[Any], None]:
        watcher = self._watchers.get(queue)
        if watcher is None:   # one per queue: kazoo keeps each watcher once
            watcher = self._watchers[queue] = functools.partial(
                weak_callback(self._on_offers), queue)
        return watcher

    def _on_offers(self, queue: str, event: Any) -> None:   # kazoo's thread: never block
        if event.path is None:   # the connection dropped: the next publish lists again
            self._drop(queue)
        else:
            self._list_async(queue)

    def _list_async(self, queue: str) -> None:
        client = self._client
        if client is None:
            return

        def done(result: Any) -> None:   # kazoo's thread
            try:
                self._store(queue, tuple(result.get()))
            except NoNodeError:
                self._drop(queue)   # gone: the next publish looks (and watches) again
            except Exception as exc:
                self._drop(queue)
                log_failure(logger, exc, "celery_zk: could not read the offers of %s",
                            queue, level=logging.DEBUG)

        try:
            client.get_children_async(self.layout.offers(queue),
                                      watch=self._watcher(queue)).rawlink(done)
        except Exception:   # closing: the next publish lists again
            self._drop(queue)

    # Writers copy the dict under the lock (held for no request) so that no
    # update is lost; readers take whatever dict is current.
    def _store(self, queue: str, names: tuple[str, ...]) -> None:
        with self._lock:
            self._offers = {**self._offers, queue: names}

    def _drop(self, queue: str) -> None:
        with self._lock:
            self._offers = {k: v for k, v in self._offers.items() if k != queue}

    def _forget(self, queue: str, offer: str) -> None:
        with self._lock:
            offers = self._offers.get(queue)
            if offers is not None and offer in offers:
                self._offers = {**self._offers, queue: tuple(o for o in offers if o != offer)}

    # -- consuming ----------------------------------------------------------------
    def make_offer(self, queue: str, consumer_id: str, token: str,
                   still_wanted: Callable[[Callable[[], None]], object],
                   failed: Callable[[], None]) -> None:
        """Create an offer, held back briefly (Queues.deferred) and never waited for.

        When it is due, ``still_wanted(send)`` decides under the offer's lock
        whether to send it (a withdrawal meanwhile must not be overtaken by the
        create). ``failed`` runs on kazoo's thread if it could not be made.
        """
        client = self.client
        path = self.layout.offer(queue, offer_name(consumer_id, token))
        self.handle.own(path)   # a connection dropped without close() deletes it too

        def done(result: Any) -> None:   # kazoo's thread: never block
            try:
                result.get()
            except NoNodeError:   # the queue was deleted: nothing to offer on
                self.handle.disown(path)
                failed()
            except Exception:   # lost with the connection: withdrawing will tell
                pass

        def send() -> None:
            client.create_async(path, ephemeral=True).rawlink(done)

        def due() -> None:
            still_wanted(send)

        self.queues.deferred.later(due)

    def withdraw(self, queue: str, consumer_id: str, token: str) -> None:
        """Delete an offer (gone already: a lost reply of ours deleted it)."""
        client = self.client
        path = self.layout.offer(queue, offer_name(consumer_id, token))
        delete_if_there(client, path)
        self.handle.disown(path)   # gone either way (a failure above keeps it ours)

    def withdraw_async(self, queue: str, consumer_id: str, token: str) -> None:
        """:meth:`withdraw`, not waited for: a consumer given work withdraws
        its offer on its way to reading that work, and the delete's synced
        write is no business of the delivery's."""
        client = self.client
        path = self.layout.offer(queue, offer_name(consumer_id, token))

        def done(result: Any) -> None:   # kazoo's thread: never block
            try:
                result.get()
            except NoNodeError:
                pass   # deleted by a retry of ours
            except Exception:   # the connection dropped: redone in the background
                self.withdraw_later(queue, consumer_id, token)
                return
            self.handle.disown(path)

        try:
            client.delete_async(path).rawlink(done)
        except Exception:   # closing, or not connected: redone in the background
            self.withdraw_later(queue, consumer_id, token)

    def taken(self, queue: str, consumer_id: str, token: str) -> None:
        """Our offer was never made (kazoo's thread), or never sent: it is not
        ours to delete."""
        self.handle.disown(self.layout.offer(queue, offer_name(consumer_id, token)))

    def withdraw_later(self, queue: str, consumer_id: str, token: str) -> None:
        """Withdraw in the background (the connection is down now)."""
        self._withdrawals.submit((queue, consumer_id, token))

    def _withdraw_again(self, item: tuple[str, str, str]) -> None:
        try:
            self.withdraw(*item)
        except Exception as exc:   # the session's end removes the offer
            log_failure(logger, exc, "celery_zk: could not withdraw the offer %s on %s; "
                        "it goes when this worker's session ends", item[2], item[0])
