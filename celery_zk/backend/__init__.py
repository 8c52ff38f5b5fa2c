"""The Celery result backend (``zk://``): done nodes, waiting on watches, chords,
expiry.

``celery_zk.backend:ZooKeeperBackend`` is the public path (the
``celery.result_backends`` entry point).
"""
from .backend import ZooKeeperBackend

__all__ = ["ZooKeeperBackend"]
