"""celery_zk: Apache ZooKeeper as a Celery broker and result backend.

Importing the package registers the ``zk://`` transport alias with kombu.
kombu has no entry point for transports, so celery_zk also ships a
``kombu.serializers`` entry point whose import runs this module: any process
that imports kombu therefore knows ``zk://`` without an explicit import.
It also arranges for Celery's groups to be published to ``zk://`` a few
hundred messages per transaction (:mod:`celery_zk.groups`).
"""
from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

__version__ = "0.1.0"

from .groups import install_when_imported

TRANSPORT_ALIASES.setdefault("zk", "celery_zk.transport:Transport")
install_when_imported()

__all__ = ["__version__"]
