"""What the last part of a chord does: read the header's results, send the body
with them (or its error), and finish the counter.

Every header result is stored once the counter says every part is counted,
so they are read in one pipelined round trip, never joined. The body's
publish makes ``~sent`` (the message property ``ONCE_PROPERTY``, honoured by a
zk:// transport on the backend's ensemble), and the count, the reads and the
run's end ride out a failover (:data:`celery_zk.zk.client.FAILOVER_PATIENCE`).
A part's own result reads STARTED until the part is counted, and the last
part's until the run is finished (:class:`PartResult`), so a part stopped in
between runs again even with ``worker_deduplicate_successful_tasks``. See
``docs/backend.md``, "Chords" and "Outages".
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any, Protocol

from celery import states
from celery.canvas import chord, group, maybe_signature
from celery.exceptions import ChordError
from celery.result import AsyncResult, GroupResult, ResultSet, allow_join_result
from kazoo.client import KazooClient, TransactionRequest

from ..zk.client import FAILOVER_PATIENCE, connected_retry
from ..zk.layout import Layout
from ..zk.names import ONCE_PROPERTY
from .chord import ChordCounter

__all__ = ["PartResult", "send_chord_body"]

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

    def encoded(self, data: Any) -> bytes: ...

    def path(self, key: Any) -> str: ...

    @property
    def layout(self) -> Layout: ...

    @property
    def settings(self) -> Any: ...

    @property
    def client(self) -> KazooClient: ...


class _PartFailed(Exception):
    def __init__(self, task_id: str, error: BaseException) -> None:
        super().__init__(task_id, error)
        self.task_id = task_id
        self.error = error


class PartResult:
    """A chord part's own stored result, shown as STARTED until the part counts.

    With ``worker_deduplicate_successful_tasks`` Celery skips a redelivered
    task whose result is SUCCESS without calling the backend. A worker stopped
    after a part's SUCCESS was stored and before the part was counted (B21),
    or after the last part was counted and before the body was sent (B7),
    left a part nobody ran again, and the body was never sent (Redis's backend
    has the same gaps). So:

    * :meth:`ZooKeeperBackend.mark_as_done` stores a part's SUCCESS as STARTED
      (:meth:`hold`) and the multi that counts the part writes the SUCCESS;
    * the last part's stays STARTED until the multi that finishes the run
      writes it (:meth:`restore`).

    Stopped in between, the part runs again and counts, or sends the body. A
    chunked result (above ``chunk_size``) is stored as SUCCESS at once.
    """

    def __init__(self, backend: ZooKeeperBackend, task_id: str) -> None:
        self.backend = backend
        self.task_id = task_id
        self.path = backend.path(backend.get_key_for_task(task_id))
        #: The SUCCESS to write once counted, and its meta (the body reads it).
        self.success: bytes | None = None
        self.meta: dict[str, Any] | None = None

    def hold(self, meta: dict[str, Any], data: bytes) -> bytes:
        """What to store for the SUCCESS ``meta`` (encoded as ``data``) until counted."""
        self.success, self.meta = data, meta
        return self.backend.encoded({**meta, "status": states.STARTED})

    def counting(self, tx: TransactionRequest, last: bool) -> None:
        """Add to the multi that counts the part: the SUCCESS, unless the part is
        the last."""
        if not last and self.success is not None:
            tx.set_data(self.path, self.success)

    def restore(self, tx: TransactionRequest) -> None:
        """Add to the finishing multi: the SUCCESS."""
        if self.success is not None:
            tx.set_data(self.path, self.success)


def send_chord_body(backend: ZooKeeperBackend, request: Any, counter: ChordCounter,
                    lazy: bool, own: PartResult | None = None) -> None:
    """The chord's every part is counted: send its body (or its error). ``own``:
    the sending part's result, STARTED until the run is finished."""
    app = backend.app
    group_id = str(request.group)
    callback = maybe_signature(request.chord, app=app)
    if lazy:   # a generator's header: its parts, in header order (see chord.py)
        header: Any = GroupResult(group_id, [AsyncResult(t, app=app) for t in counter.parts()],
                                  app=app)
    else:
        header = _patiently(backend, partial(GroupResult.restore, group_id, app=app,
                                             backend=backend))
    try:
        if header is None:
            _fail(backend, callback, group_id, f"GroupResult {group_id} no longer exists")
            return
        try:
            metas = _patiently(backend, partial(_metas, backend, header))
            if own is not None and own.meta is not None:
                metas[own.task_id] = own.meta   # stored as STARTED meanwhile
            values = _values(backend, header, metas)
        except _PartFailed as failed:
            _fail(backend, callback, group_id,
                  f"Dependency {failed.task_id} raised {failed.error!r}", failed.error)
            return
        except Exception as exc:   # a part's result could not be read
            _fail(backend, callback, group_id, repr(exc), exc)
            return
        try:
            # Celery's publish retry (task_publish_retry_policy) rides out a
            # failover: three more tries, each of the transport's command retry.
            callback.apply_async((values,), **_sent_once(backend, group_id, callback))
        except Exception as exc:
            logger.exception("Chord %r raised: %r", group_id, exc)
            _fail(backend, callback, group_id, f"Callback error: {exc!r}", exc)
    finally:
        if header is not None:
            backend.delete_group(group_id)
        counter.finish(also=None if own is None else own.restore)


def _patiently(backend: ZooKeeperBackend, step: Any) -> Any:
    """``step()`` with a result write's failover patience: run again while its
    own requests give up for want of ZooKeeper (their RetryFailedError ends an
    attempt, which connected_retry starts again until the patience is spent)."""
    return connected_retry(backend.client, step, patience=FAILOVER_PATIENCE)


def _sent_once(backend: ZooKeeperBackend, group_id: str, callback: Any) -> dict[str, Any]:
    """The publish option that makes the body's publish and the counter's
    ``~sent`` one multi, when the broker is zk:// (our transport honours it, and
    drops it if it is on another ensemble); a group or chord as the body is
    more than one publish, and is left as it was."""
    conf = backend.app.conf
    url = conf.broker_write_url or conf.broker_url
    urls = url if isinstance(url, (list, tuple)) else str(url or "").split(";")
    if not urls or not all(str(u).strip().startswith("zk://") for u in urls):
        return {}
    if isinstance(callback, (group, chord)):
        return {}
    settings = backend.settings
    return {ONCE_PROPERTY: {"hosts": settings.hosts, "username": settings.username,
                            "path": backend.layout.chord_sent(group_id)}}


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
