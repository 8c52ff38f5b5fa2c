"""Celery's private names that celery_zk uses (Celery 5.3 to 5.7), but its
worker pools' (:mod:`celery_zk.compat.celery_pool`).

* **Group publishing**, ``group._apply_tasks``: Celery has no hook for "a
  group is being published", so :mod:`celery_zk.broker.groups` wraps this
  generator to store a group's messages a few hundred per multi. Fallback:
  each task is published on its own, as on every other broker.
* **Lazy headers**, ``celery.utils.functional._regen``: the type Celery keeps
  a group's or chord header's tasks in when they were given as a generator;
  those are published (and counted) as they come, never held. Fallback:
  anything but a plain list or tuple counts as lazy.
* **URL masking**, ``celery.app.utils.sanitize_url`` (Celery 5.7) or the
  ``maybe_sanitize_url`` it imported from kombu before: ``celery report`` and
  ``app.conf.humanize()`` mask result backend URLs through it, and celery_zk
  masks the passwords a ``zk://`` URL keeps in its query too. Fallback:
  Celery's own masking (the ``user:password@`` part only), with a warning.
* **Backend hooks**: what a key/value result backend overrides or reads of
  Celery's base classes (:data:`BACKEND_HOOKS`), as Celery's own Redis backend
  does. No fallback: checked by the tests, and named by the error if gone.
* **Waiters by task id** (celery#4925): before Celery 5.7 the backend's
  ``_pending_results`` holds one result object per task id, and *any* object
  of that id being garbage-collected (a copy Celery made and dropped while
  publishing a group) removes the waiter, whose ``get()`` then hangs.
  :func:`is_stray_copy` tells such a copy by the map's shape (Celery 5.7
  keeps every waiter and fixed it itself).
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from . import PrivateAPIChanged, describe

__all__ = ["BACKEND_HOOKS", "is_lazy", "is_stray_copy", "missing", "wrap_group_apply_tasks",
           "wrap_url_masking"]

logger = logging.getLogger(__name__)

#: The leading parameters of ``group._apply_tasks`` the group wrapper relies on.
APPLY_TASKS_PARAMETERS = ["self", "tasks", "producer", "app"]

#: The names of ``celery.app.utils`` Celery has masked URLs with, newest first.
URL_MASKERS = ("sanitize_url", "maybe_sanitize_url")

#: ``(module, class, name)`` of each base-class member ZooKeeperBackend
#: overrides or reads (``celery_zk/backend/backend.py``).
BACKEND_HOOKS: tuple[tuple[str, str, str], ...] = (
    ("celery.backends.base", "BaseKeyValueStoreBackend", "_apply_chord_incr"),
    ("celery.backends.base", "BaseKeyValueStoreBackend", "_store_result"),
    ("celery.backends.base", "BaseBackend", "_get_result_meta"),
    ("celery.backends.base", "BaseBackend", "set_chord_size"),
    ("celery.backends.base", "BaseBackend", "add_to_chord"),
)
#: Set by ``BaseBackend.__init__``; a result consumer is given the first two.
BACKEND_INSTANCE = ("_pending_results", "_pending_messages", "_cache")


def _changed(name: str, used_for: str, consequence: str) -> PrivateAPIChanged:
    return PrivateAPIChanged(describe("celery", name, used_for, consequence))


def _group_apply_tasks() -> Any:
    from celery.canvas import group

    return getattr(group, "_apply_tasks", None)


def _apply_tasks_problem(original: Any) -> str | None:
    if original is None:
        return "group._apply_tasks"
    if getattr(original, "_celery_zk", False):
        original = original.__wrapped__
    if (not inspect.isgeneratorfunction(original)
            or list(inspect.signature(original).parameters)[:4] != APPLY_TASKS_PARAMETERS):
        return f"group._apply_tasks({', '.join(APPLY_TASKS_PARAMETERS)}, ...) as a generator"
    return None


def wrap_group_apply_tasks(make: Callable[[Any], Callable[..., Any]]) -> bool:
    """Replace ``group._apply_tasks`` by ``make(original)`` (once); False, and
    Celery's left as it is, when it is not the one this was written against."""
    from celery.canvas import group

    original = _group_apply_tasks()
    if getattr(original, "_celery_zk", False):
        return True
    problem = _apply_tasks_problem(original)
    if problem is not None:
        logger.warning("%s", _changed(problem, "to store a group's messages together",
                                      "Groups are published task by task."))
        return False
    wrapper = make(original)
    wrapper._celery_zk = True  # type: ignore[attr-defined]
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    group._apply_tasks = wrapper
    return True


def is_lazy(tasks: Any) -> bool:
    """Whether a group's tasks (or a header's frozen results) come from a
    generator, to be consumed as they come."""
    from celery.utils import functional

    lazy_type = getattr(functional, "_regen", None)
    if isinstance(lazy_type, type):
        return isinstance(tasks, lazy_type)
    return type(tasks) not in (list, tuple)


def wrap_url_masking(hide: Callable[[str], str], schemes: frozenset[str]) -> bool:
    """Make Celery mask URLs of ``schemes`` with ``hide`` (idempotent); False
    when Celery masks with neither name of :data:`URL_MASKERS`."""
    try:
        from celery.app import utils
    except ImportError:
        return False
    for name in URL_MASKERS:
        celery_mask = getattr(utils, name, None)
        if callable(celery_mask):
            break
    else:
        logger.warning("%s", _changed(
            f"celery.app.utils.{' or '.join(URL_MASKERS)}",
            "to mask the passwords of zk:// URL options in `celery report`",
            "Celery's own masking hides only the user:password@ part."))
        return False
    if getattr(celery_mask, "_celery_zk", False):
        return True

    def masked(url: Any, mask: str = "*" * 8) -> Any:   # Celery passes mask=
        if isinstance(url, str) and url.partition("://")[0] in schemes:
            return hide(url)
        return celery_mask(url, mask=mask)

    masked._celery_zk = True  # type: ignore[attr-defined]
    setattr(utils, name, masked)
    return True


def is_stray_copy(pending_results: Any, result: Any) -> bool:
    """Whether ``result`` is not the object waiting on its task id in a pending
    map that holds one object per id (Celery before 5.7; see above)."""
    for mapping in pending_results:
        registered = mapping.get(result.id)
        if registered is not None and hasattr(registered, "id"):   # one object, not a dict
            return registered is not result
    return False


def missing(backend: Any = None) -> list[str]:
    """What the installed Celery lacks of the names above, one message each (with
    ``backend``, a ZooKeeperBackend instance, its base's attributes too)."""
    import importlib

    from celery.app import utils
    from celery.utils import functional

    problems = []
    problem = _apply_tasks_problem(_group_apply_tasks())
    if problem is not None:
        problems.append(str(_changed(problem, "to store a group's messages together",
                                     "Groups are published task by task.")))
    if not isinstance(getattr(functional, "_regen", None), type):
        problems.append(str(_changed("celery.utils.functional._regen",
                                     "to tell generator headers from lists",
                                     "Anything but a list or tuple counts as a generator.")))
    if not any(callable(getattr(utils, name, None)) for name in URL_MASKERS):
        problems.append(str(_changed(f"celery.app.utils.{' or '.join(URL_MASKERS)}",
                                     "to mask zk:// URL options in reports",
                                     "Only user:password@ is masked.")))
    for module, cls, name in BACKEND_HOOKS:
        owner = getattr(importlib.import_module(module), cls, None)
        if not callable(getattr(owner, name, None)):
            problems.append(str(_changed(f"{cls}.{name}", "as a result backend",
                                         "The zk:// result backend cannot work.")))
    if backend is not None:
        problems += [str(_changed(f"BaseBackend().{name}", "as a result backend",
                                  "The zk:// result backend cannot work."))
                     for name in BACKEND_INSTANCE if not hasattr(backend, name)]
    return problems
