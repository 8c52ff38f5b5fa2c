"""A group's messages stored together: a few multis instead of a create per task.

The group's publishes to a ``zk://`` broker are held by
:func:`publish_together` and stored when the group ends, 256 per multi;
``group.apply_async()`` still returns only once every message is stored.
Celery has no hook for it, so this wraps ``group._apply_tasks`` (fenced in
:mod:`celery_zk.compat.celery`), only when its signature is the known one,
as soon as ``celery.canvas`` is imported (:func:`install_when_imported`, run
by ``import celery_zk``), so even a process whose first publish is a group
batches it. See ``docs/configuration.md``, "Groups and chord headers".
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from ..compat.celery import is_lazy, wrap_group_apply_tasks
from ..compat.kazoo import QuotaExceededError

logger = logging.getLogger(__name__)

#: This thread's open publish_together: the messages it holds, per Publisher.
_together = threading.local()

_CANVAS = "celery.canvas"


def install_when_imported() -> None:
    """:func:`install` now if Celery's ``group`` class exists, else right after.

    ``celery_zk`` is imported with kombu (its serializer entry point), often
    before Celery loads its canvas or while it is loading it (the canvas
    imports kombu); importing it from here would slow every kombu user and
    can be an import cycle. So a finder waits: it installs right after
    ``celery.canvas`` is loaded, or, if that import is already under way, at
    the first import after it has finished. (Importing the zk transport
    imports ``celery_zk``, so it has run wherever the transport is used.)
    """
    if _group_class() is not None:
        install()
    elif not any(isinstance(finder, _AfterCanvas) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterCanvas())


def _group_class() -> Any:
    return getattr(sys.modules.get(_CANVAS), "group", None)


class _AfterCanvas(importlib.abc.MetaPathFinder):
    """Finds nothing itself: runs :func:`install` once Celery's canvas is loaded."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> Any:
        if _group_class() is not None:   # its import finished since we were added
            self._leave()
            install()
            return None
        if fullname != _CANVAS or _CANVAS in sys.modules:
            return None
        self._leave()   # and so the lookup below finds the real spec
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        real_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            real_exec(module)
            install()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def _leave(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def install() -> bool:
    """Wrap ``group._apply_tasks`` (once); False if this Celery's differs."""
    return wrap_group_apply_tasks(_batched)


def _batched(original: Any) -> Any:
    @functools.wraps(original)
    def _apply_tasks(self: Any, tasks: Any, producer: Any = None, app: Any = None,
                     *args: Any, **kwargs: Any) -> Iterator[Any]:
        app = app or self.app
        with app.producer_or_acquire(producer) as producer:
            # A generator is published as it yields (celery#3021): its first
            # tasks run while later ones are still being made, and it is never
            # held whole in memory.
            together = None if is_lazy(self.tasks) else _publish_together(producer)
            if together is None:
                yield from original(self, tasks, producer, app, *args, **kwargs)
                return
            with together():
                yield from original(self, tasks, producer, app, *args, **kwargs)

    return _apply_tasks


@contextmanager
def publish_together() -> Iterator[None]:
    """Confirmed publishes of this thread to ``zk://`` inside are stored when it
    ends, a few hundred per multi (:meth:`Publisher.put_batch`), instead of one
    round trip each. Celery's groups and chord headers use it (:mod:`celery_zk.broker.groups`).

    Nested uses join the outermost. Publishes made before an exception are
    stored too, as they would have been one by one. With
    ``confirm_publish=False`` they are stored (and confirmed) the same way:
    fewer requests than pipelined creates, and after those in order.
    """
    if getattr(_together, "held", None) is not None:
        yield
        return
    _together.held = {}
    try:
        yield
    finally:
        held, _together.held = _together.held, None
        failure: BaseException | None = None
        for publisher, messages in held.items():   # each connection's, in its own order
            try:
                if messages:
                    publisher.put_batch(messages)
                    publisher.queues.deferred.flush()   # the write they waited for has been made
            except QuotaExceededError as exc:   # the servers enforce the root's quota
                # Imported here: this module loads with celery_zk, before Celery does.
                from .budget import refused
                failure = failure or refused(publisher.layout, exc)
            except BaseException as exc:   # the other connections' still go
                failure = failure or exc
        if failure is not None:
            raise failure


def held_by_this_thread() -> dict[Any, list[Any]] | None:
    """The messages this thread's open :func:`publish_together` holds, per
    Publisher (None: none is open)."""
    return getattr(_together, "held", None)


def _publish_together(producer: Any) -> Any:
    """:func:`publish_together` if ``producer`` publishes to a
    ``zk://`` broker that batches groups, else None.

    Looks at the connection's transport without opening a channel: for other
    brokers nothing may happen here that their publish would not do itself.
    """
    connection = getattr(producer, "connection", None)
    transport = getattr(connection, "transport", None)
    if transport is None or not getattr(transport, "batches_groups", False):
        return None
    return publish_together
