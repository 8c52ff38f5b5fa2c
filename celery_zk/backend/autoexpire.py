"""Results expire without beat: one cleaner per root at a time.

The backend says it expires by itself (``supports_autoexpire``, so beat
schedules no ``celery.backend_cleanup``), and each worker's main process
looks every ``expire_every`` seconds whether this root is due for a round of
:meth:`~celery_zk.backend.ZooKeeperBackend.cleanup`: an elected round
(:mod:`celery_zk.zk.rounds`) stamped on ``expiry/`` (whose data nothing else
may write), locked by the ephemeral ``expiry/~cleaner``. See
``docs/backend.md``, "Expiry and cleanup".
"""
from __future__ import annotations

from typing import Any

from celery.signals import worker_ready, worker_shutdown

from ..zk.rounds import Rounds

__all__ = ["cleaner"]

_running: dict[int, Rounds] = {}   # id(app) -> its cleaner, in this process


def cleaner(backend: Any, every: float) -> Rounds:
    """The rounds that run ``backend.cleanup()`` when its root is due."""
    layout = backend.layout
    return Rounds("expired results", every, layout.expiry, layout.expiry_cleaner,
                  lambda: backend.client, backend.cleanup, lambda: backend.clock())


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
    rounds = _running[id(app)] = cleaner(backend, every)
    rounds.start()


@worker_shutdown.connect(weak=False)
def _on_worker_shutdown(**_: Any) -> None:
    while _running:
        _running.popitem()[1].stop()
