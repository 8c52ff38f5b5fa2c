"""What the last part of a chord does: read the header's results, send the body
with them (or its error), and finish the counter.

Celery's key/value protocol does this by restoring the saved header and
*joining* it, which waits for results through the result consumer. When the
counter says every part is counted, every header result is already stored,
so here they are read in one pipelined round trip instead. That also keeps
the behaviour the same on every Celery release celery_zk supports: Celery
before 5.7 could not join a header that nests a group from inside the
protocol (the join waited on the nested group's promise, which nothing
resolved, until ``result_chord_join_timeout``), and Celery 5.3 ended its
protocol with ``self.client.delete(key)``, which a backend whose client is
kazoo cannot take.

The outcome is Celery's: the body gets the header's results in header order
(a nested group's as a list); the first failed part fails the body with
``ChordError('Dependency {id} raised {exc!r}')`` (its ``__cause__`` the part's
error), delivered to the body's errbacks by Celery's
``chord_error_from_stack``; a body that cannot be sent fails with
``ChordError('Callback error: ...')``.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from celery import states
from celery.canvas import maybe_signature
from celery.exceptions import ChordError
from celery.result import AsyncResult, GroupResult, ResultSet, allow_join_result

from .chord import ChordCounter

__all__ = ["send_chord_body"]

logger = logging.getLogger(__name__)


class ZooKeeperBackend(Protocol):
    """What of the result backend this module uses."""

    app: Any

    def mget(self, keys: Iterable[Any]) -> list[bytes | None]: ...

    def get_key_for_task(self, task_id: str, key: str = "") -> Any: ...

    def decode_result(self, payload: Any) -> dict[str, Any]: ...

    def get_task_meta(self, task_id: str, cache: bool = True) -> dict[str, Any]: ...

    def chord_error_from_stack(self, callback: Any, exc: Any = None) -> Any: ...

    def delete_group(self, group_id: str) -> Any: ...


class _PartFailed(Exception):
    def __init__(self, task_id: str, error: BaseException) -> None:
        super().__init__(task_id, error)
        self.task_id = task_id
        self.error = error


def send_chord_body(backend: ZooKeeperBackend, request: Any, counter: ChordCounter,
                    lazy: bool) -> None:
    """The chord's every part is counted: send its body (or its error)."""
    app = backend.app
    group_id = str(request.group)
    callback = maybe_signature(request.chord, app=app)
    if lazy:   # a generator's header: its parts, in header order (see chord.py)
        header: Any = GroupResult(group_id, [AsyncResult(t, app=app) for t in counter.parts()],
                                  app=app)
    else:
        header = GroupResult.restore(group_id, app=app, backend=backend)
    try:
        if header is None:
            _fail(backend, callback, group_id, f"GroupResult {group_id} no longer exists")
            return
        try:
            values = _values(backend, header, _metas(backend, header))
        except _PartFailed as failed:
            _fail(backend, callback, group_id,
                  f"Dependency {failed.task_id} raised {failed.error!r}", failed.error)
            return
        except Exception as exc:   # a part's result could not be read
            _fail(backend, callback, group_id, repr(exc), exc)
            return
        try:
            callback.delay(values)
        except Exception as exc:
            logger.exception("Chord %r raised: %r", group_id, exc)
            _fail(backend, callback, group_id, f"Callback error: {exc!r}", exc)
    finally:
        if header is not None:
            backend.delete_group(group_id)
        counter.finish()


def _fail(backend: ZooKeeperBackend, callback: Any, group_id: str, reason: str,
          cause: BaseException | None = None) -> None:
    logger.error("Chord %r raised: %r", group_id, reason)
    error = ChordError(reason)
    if isinstance(cause, Exception):
        error.__cause__ = cause
    backend.chord_error_from_stack(callback, error)


def _leaves(result: Any) -> Iterator[AsyncResult]:
    if isinstance(result, ResultSet):
        for child in result.results:
            yield from _leaves(child)
    else:
        yield result


def _metas(backend: ZooKeeperBackend, header: Any) -> dict[str, dict[str, Any]]:
    """Every part's result meta, read in one round trip."""
    ids = [leaf.id for leaf in _leaves(header)]
    datas = backend.mget([backend.get_key_for_task(task_id) for task_id in ids])
    return {task_id: backend.decode_result(data)
            for task_id, data in zip(ids, datas) if data}


def _values(backend: ZooKeeperBackend, result: Any, metas: dict[str, dict[str, Any]]) -> Any:
    """The value the body gets for ``result``: a nested group's as a list."""
    if isinstance(result, ResultSet):
        return [_values(backend, child, metas) for child in result.results]
    meta = metas.get(result.id)
    if meta is None or meta["status"] not in states.READY_STATES:
        # Counted, but no result to read (it was not stored, or is being
        # rewritten): wait for it as Celery's join would.
        with allow_join_result():
            result.get(timeout=backend.app.conf.result_chord_join_timeout, propagate=False)
        meta = backend.get_task_meta(result.id)
    if meta["status"] in states.PROPAGATE_STATES:
        raise _PartFailed(result.id, meta["result"])
    return meta["result"]
