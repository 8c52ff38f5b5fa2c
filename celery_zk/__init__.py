"""celery_zk: Apache ZooKeeper as a Celery broker and result backend.

Importing the package registers the ``zk://`` transport alias with kombu.
kombu has no entry point for transports, so celery_zk also ships a
``kombu.serializers`` entry point whose import runs this module: any process
that imports kombu therefore knows ``zk://`` without an explicit import.
"""
from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

__version__ = "0.1.0"

TRANSPORT_ALIASES.setdefault("zk", "celery_zk.transport:Transport")

__all__ = ["__version__"]
