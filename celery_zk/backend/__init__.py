"""The Celery result backend (``zk://``): done nodes, waiting on watches, chords,
expiry.

``celery_zk.backend:ZooKeeperBackend`` is the public path (the
``celery.result_backends`` entry point).
"""
from . import autoexpire  # noqa: F401  (connects its worker signals)
from .backend import ZooKeeperBackend

__all__ = ["ZooKeeperBackend"]
