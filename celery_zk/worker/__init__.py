"""What celery_zk adds inside a Celery worker process, apart from the transport:
Celery's worker signals (:mod:`.hooks`), the thread pool's start gate
(:mod:`.start_gate`) and the prefork child's (:mod:`.child_gate`).

The transport knows none of them but the one hook object :mod:`.hooks` gives it
(``celery_zk.broker.transport.worker``) at ``worker_init``;
:mod:`celery_zk.transport` imports this package so that the signal handlers are
connected before Celery sends it. See ``docs/design.md``, "Module map".
"""
from __future__ import annotations

from . import hooks

__all__ = ["hooks"]
