"""Work one process of a root does at a time, on a schedule: an elected round
(results expired, queues unused for their ``x-expires``).

Each process looks every ``every`` seconds. A round is due when its *stamp*
node was last modified that long ago (the server's clock), or never; whoever
creates the ephemeral *lock* runs it, then stamps and deletes the lock in one
multi. Nothing else may write the stamp's data. A round's requests are made
from its own thread, never from kazoo's or from the background thread, whose
held-back writes must not wait for it. See ``docs/backend.md``, "Expiry and
cleanup".
"""
from __future__ import annotations

import logging
import random
import threading
import time
from typing import Callable

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError
from kazoo.protocol.states import ZnodeStat

from .client import CONNECTION_ERRORS, log_failure

__all__ = ["Rounds", "stamped_at"]

logger = logging.getLogger(__name__)


def stamped_at(stat: ZnodeStat | None) -> float | None:
    """When the last round ended (seconds since the epoch), from the stamp's
    stat; None: never."""
    return stat.last_modified if stat is not None and stat.version > 0 else None


class Rounds:
    """Runs ``work`` when the root is due for it and no other process is
    running it (see the module docstring)."""

    def __init__(self, what: str, every: float, stamp: str, lock: str,
                 client: Callable[[], KazooClient], work: Callable[[], object],
                 clock: Callable[[], float] = time.time) -> None:
        self.what = what   # for the log: "expired results", "unused queues"
        self.every = every
        self.stamp, self.lock = stamp, lock
        self.client = client   # looked up at each round: a reconnect makes a new one
        self.work = work
        self.clock = clock
        self._stop = threading.Event()

    def run_if_due(self) -> bool:
        """One look; True when this process ran a round."""
        client = self.client()
        stat = client.exists(self.stamp)
        if stat is None:
            return False   # nothing was ever written under this root
        last = stamped_at(stat)
        if last is not None and self.clock() - last < self.every:
            return False
        try:
            client.create(self.lock, ephemeral=True)
        except NodeExistsError:
            return False   # another process runs it
        stamped = False
        try:
            now_stat = client.exists(self.stamp)
            if now_stat is None or now_stat.version != stat.version:
                return False   # a round ended between our look and our lock
            self.work()
            tx = client.transaction()
            tx.set_data(self.stamp, b"", version=now_stat.version)
            tx.delete(self.lock)
            # A failed multi (only a lock lost with our session, or a stamp
            # written by someone else) leaves the stamp for the next round.
            stamped = not any(isinstance(r, Exception) for r in tx.commit())
            return True
        finally:
            if not stamped:
                self._unlock(client)

    def _unlock(self, client: KazooClient) -> None:
        try:
            client.delete(self.lock)
        except (NoNodeError, *CONNECTION_ERRORS):
            pass   # gone already, or ephemeral: it goes with the session

    def start(self) -> None:
        threading.Thread(target=self._run, name="celery_zk-" + self.what.replace(" ", "-"),
                         daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        # The first look at a random moment: a fleet started together spreads out.
        wait = random.uniform(0.0, self.every)
        while not self._stop.wait(wait):
            wait = self.every
            started = time.monotonic()
            try:
                if self.run_if_due():
                    logger.info("celery_zk: %s cleaned in %.1f s", self.what,
                                time.monotonic() - started)
            except Exception as exc:   # the next look tries again
                log_failure(logger, exc, "celery_zk: cleaning %s failed", self.what)
