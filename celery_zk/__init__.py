"""celery_zk: Apache ZooKeeper as a Celery broker and result backend.

Importing the package registers the ``zk://`` transport alias with kombu.
kombu has no entry point for transports, so celery_zk also ships a
``kombu.serializers`` entry point whose import runs this module: any process
that imports kombu therefore knows ``zk://`` without an explicit import.
It also arranges for Celery's groups to be published to ``zk://`` a few
hundred messages per transaction (:mod:`celery_zk.broker.groups`).
"""
from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

__version__ = "0.4.0"   # as setup.cfg says (test_package_layout checks)

from .broker.groups import install_when_imported

TRANSPORT_ALIASES.setdefault("zk", "celery_zk.transport:Transport")
install_when_imported()

__all__ = ["LockHeld", "Singleton", "__version__", "affinity"]


def __getattr__(name: str) -> object:
    """``celery_zk.Singleton`` / ``LockHeld`` and ``celery_zk.affinity``, imported on
    first use: this package is imported with kombu, before Celery's Task class
    may be importable, and most processes use neither."""
    if name in ("Singleton", "LockHeld"):
        from .features import singleton
        return getattr(singleton, name)
    if name == "affinity":
        from .features import affinity
        return affinity
    raise AttributeError(f"module 'celery_zk' has no attribute {name!r}")
