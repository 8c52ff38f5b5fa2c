"""Every error celery_zk raises on purpose.

Each message says what was wrong and what to do about it.
"""
from __future__ import annotations

from celery.exceptions import ImproperlyConfigured
from kombu.exceptions import EncodeError


class CeleryZKError(Exception):
    """Base class for celery_zk's own runtime errors."""


class ZKConfigurationError(ImproperlyConfigured, ValueError):
    """A broker/backend URL or transport option is wrong."""


class ZooKeeperNotInstalled(CeleryZKError):
    """No local ZooKeeper installation was found for the launcher."""


class PortInUse(CeleryZKError):
    """The launcher was asked for a port another process already holds."""


class ServerStartError(CeleryZKError):
    """A launched ZooKeeper did not come up; the message carries its log tail."""


class MessageTooLarge(CeleryZKError, ValueError):
    """A message or result does not fit in one znode (ZooKeeper's jute.maxbuffer)."""


class ResultTooLarge(MessageTooLarge, EncodeError):
    """A task's result meta does not fit in one znode.

    Also a kombu ``EncodeError``: Celery's tracer then records the task as
    failed with this error, as it does for a result that cannot be serialized,
    and the worker carries on.
    """


class StorageFull(CeleryZKError):
    """A publish met the root's storage budget (options ``budget_nodes``,
    ``budget_bytes``) and waited ``budget_wait`` seconds in vain, or the
    servers' own quota refused it. Nothing was written; the message says what
    is full and what to do (``docs/operations.md``)."""


class QueueFull(CeleryZKError):
    """A publish to a queue at its ``x-max-length`` with ``x-overflow``
    ``reject-publish``. Nothing was written."""


class PayloadError(CeleryZKError):
    """A chunked payload (celery_zk.zk.payload) cannot be written or read whole:
    its bytes do not match their manifest, or a container is not where it
    should be. The message names the node."""


class ChunkMissing(PayloadError):
    """A chunk a manifest names is gone (deleted with its payload meanwhile, or
    by hand). ``path`` is the missing node."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:   # picklable with its path
        return (type(self), (str(self), self.path))


class ZKConnectionError(CeleryZKError, ConnectionError):
    """ZooKeeper could not be reached within the connect timeout."""


class ZKServerTooOld(ZKConfigurationError):
    """The ZooKeeper servers are older than celery_zk needs (3.6)."""


class ZKAuthError(CeleryZKError, PermissionError):
    """ZooKeeper refused the URL's credentials."""
