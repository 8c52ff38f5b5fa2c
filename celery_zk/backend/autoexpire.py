"""Results expire without beat: one cleaner per root at a time.

Celery deletes expired results only when something calls the backend's
``cleanup()``: ``celery beat``'s ``celery.backend_cleanup`` (daily at 04:00),
scheduled for backends that do not expire by themselves. Redis keys expire by
themselves, so most deployments run no beat; on ZooKeeper their results would
stay in every server's memory for good. So the backend says it expires by
itself (``supports_autoexpire``), and each worker's main process looks every
``expire_every`` seconds whether this root is due for a round:

* ``expiry/`` was last modified when the last round ended (its data is
  never written otherwise; the server's clock); a round is due when none has
  ended yet (version 0) or one ended ``expire_every`` ago;
* the process that creates the ephemeral ``expiry/~cleaner`` runs it
  (:meth:`~celery_zk.backend.ZooKeeperBackend.cleanup`, in batches), then
  stamps ``expiry/`` and deletes the lock in one multi. Everyone else finds
  the lock and looks again later; a cleaner whose session ends mid-round
  leaves the round to whoever looks next (nothing is stamped).

Its requests are made from its own thread, never from kazoo's or from the
process's background thread, whose held-back writes must not wait for a round.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

from celery.signals import worker_ready, worker_shutdown
from kazoo.exceptions import NodeExistsError, NoNodeError
from kazoo.protocol.states import ZnodeStat

from ..zk.client import CONNECTION_ERRORS, log_failure

__all__ = ["Cleaner", "cleaned_at"]

logger = logging.getLogger(__name__)

_running: dict[int, Cleaner] = {}   # id(app) -> its cleaner, in this process


def cleaned_at(stat: ZnodeStat | None) -> float | None:
    """When the last round ended (seconds since the epoch), from the stat of
    ``expiry/``; None: never."""
    return stat.last_modified if stat is not None and stat.version > 0 else None


class Cleaner:
    """Runs ``backend.cleanup()`` when this root is due for it and no other
    process is running it (see the module docstring)."""

    def __init__(self, backend: Any, every: float) -> None:
        self.backend = backend
        self.every = every
        self._stop = threading.Event()

    def clean_if_due(self) -> bool:
        """One look; True when this process ran a round."""
        backend, layout = self.backend, self.backend.layout
        client = backend.client
        stat = client.exists(layout.expiry)
        if stat is None:
            return False   # nothing was ever written under this root
        last = cleaned_at(stat)
        if last is not None and backend.clock() - last < self.every:
            return False
        try:
            client.create(layout.expiry_cleaner, ephemeral=True)
        except NodeExistsError:
            return False   # another process is cleaning
        stamped = False
        try:
            now_stat = client.exists(layout.expiry)
            if now_stat is None or now_stat.version != stat.version:
                return False   # a round ended between our look and our lock
            backend.cleanup()
            tx = client.transaction()
            tx.set_data(layout.expiry, b"", version=now_stat.version)   # the stamp
            tx.delete(layout.expiry_cleaner)
            # A failed multi (beat's cleanup() stamps nothing, so only a lock
            # lost with our session) leaves the stamp for the next round.
            stamped = not any(isinstance(r, Exception) for r in tx.commit())
            return True
        finally:
            if not stamped:
                self._unlock()

    def _unlock(self) -> None:
        try:
            self.backend.client.delete(self.backend.layout.expiry_cleaner)
        except (NoNodeError, *CONNECTION_ERRORS):
            pass   # gone already, or ephemeral: it goes with the session

    def start(self) -> None:
        threading.Thread(target=self._run, name="celery_zk-expiry", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        # The first look at a random moment: a fleet started together spreads out.
        wait = random.uniform(0.0, self.every)
        while not self._stop.wait(wait):
            wait = self.every
            started = time.monotonic()
            try:
                if self.clean_if_due():
                    logger.info("celery_zk: expired results cleaned under %s in %.1f s",
                                self.backend.settings.sanitized_url(),
                                time.monotonic() - started)
            except Exception as exc:   # the next look tries again
                log_failure(logger, exc, "celery_zk: cleaning expired results failed")


@worker_ready.connect(weak=False)
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    """A worker's main process starts its app's cleaner (a zk:// backend with a
    ``result_expires`` and ``expire_every`` above 0)."""
    from .backend import ZooKeeperBackend

    app = getattr(sender, "app", None)
    backend = getattr(app, "backend", None)
    if not isinstance(backend, ZooKeeperBackend) or not backend.expires:
        return
    every = backend.settings.options.expire_every
    if every <= 0 or id(app) in _running:
        return
    cleaner = _running[id(app)] = Cleaner(backend, every)
    cleaner.start()


@worker_shutdown.connect(weak=False)
def _on_worker_shutdown(**_: Any) -> None:
    while _running:
        _running.popitem()[1].stop()
