"""Every private name of a dependency that celery_zk touches, fenced: one module
per dependency (:mod:`.kazoo`, :mod:`.celery` with :mod:`.celery_pool` for its
worker pools, :mod:`.kombu`), and no other
module of celery_zk reaches past a dependency's public API.

Each private access is found by feature detection, never by version number.
Where one has a fallback (kazoo's connection internals for persistent
watches, Celery's group publishing, Celery's URL masking) the fallback is
taken and logged once; where none exists (the kombu QoS internals every
virtual transport reads) the transport refuses to start with a message
naming what is missing. Each module's :func:`missing` lists what the
installed release lacks; ``tests/unit/test_compat.py`` fails, naming the
release and the name, on a release where one changed.
"""
from __future__ import annotations

__all__ = ["PrivateAPIChanged", "describe"]


class PrivateAPIChanged(AttributeError):
    """A private name celery_zk relies on is not what it was written against.

    An ``AttributeError``: callers that have a fallback catch it and take it.
    """


def describe(package: str, name: str, used_for: str, consequence: str) -> str:
    """The one wording every fenced access fails with."""
    import importlib.metadata

    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = "(unknown version)"
    return (f"{package} {version} has no {name} as celery_zk expects; celery_zk uses it "
            f"{used_for}. {consequence} Report it with your {package} version, or install "
            f"a {package} release celery_zk supports (see its README).")
