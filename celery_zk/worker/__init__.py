"""What celery_zk adds inside a Celery worker process, apart from the transport.

* :mod:`.hooks`: Celery's ``worker_init`` and ``worker_shutting_down``
  signals, and what a consuming connection of a worker does once
  (revokes kept in ZooKeeper loaded, start gates installed);
* :mod:`.start_gate`: a thread pool starts a task only while the session it
  was delivered under is known live;
* :mod:`.child_gate`: a prefork child reads a task's kept revoke before it
  starts it, around a cut-off or a pause.

The kombu transport (:mod:`celery_zk.broker`) knows none of them: it calls
the hooks :mod:`.hooks` gives it (``celery_zk.broker.transport.worker``) in
a process whose worker has started. :mod:`celery_zk.transport`, the path
kombu loads the transport from, imports this package, so the signal handlers
are connected before Celery sends ``worker_init``.
"""
from __future__ import annotations

from . import hooks

__all__ = ["hooks"]
