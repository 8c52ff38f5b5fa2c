"""The public path of the kombu transport: ``celery_zk.transport:Transport``
(kombu's ``zk`` alias), kept while the code lives in :mod:`celery_zk.broker`.
Importing it connects :mod:`celery_zk.worker`'s Celery signal handlers: a
worker loads its transport before it sends ``worker_init``."""
from . import worker  # noqa: F401 - its signal handlers
from .broker.channel import Channel, QoS
from .broker.groups import publish_together
from .broker.transport import Transport

__all__ = ["Channel", "QoS", "Transport", "publish_together"]
