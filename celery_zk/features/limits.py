"""Rate and concurrency limits that hold across every worker of an app.

Each queue's one dispatcher gives every message to a worker, so it holds the
limits for all of them: a rate per task name or queue over any window (the
give times kept in the multi that gives), a concurrency per task name or per
key, counted until a task ends whatever its ack mode
(:mod:`celery_zk.broker.slots`). The dispatcher limits from names alone:
messages carry their task's token and key's token
(:func:`~celery_zk.zk.message_names.task_token`, :func:`limit_tokens`, filled
by the transport as it publishes). Limits live under ``{root}/limits/``. See
``docs/features.md``, "Cluster-wide rate and concurrency limits".
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from celery.signals import worker_ready
from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError

from ..exceptions import ZKConfigurationError
from ..zk.client import answered
from ..zk.layout import Layout
from ..zk.message_names import limit_key_token, task_token
from ..zk.tree import delete_tree

__all__ = ["HEADER", "QUEUE", "TASK", "Book", "Limit", "LimitStore", "book_for", "configured",
           "limit_target", "limit_tokens", "parse_rate"]

logger = logging.getLogger(__name__)

#: The message header a concurrency key travels in (set where it is published).
HEADER = "zk_limit_key"
TASK, QUEUE = "t", "q"   # what a limit is on (its node's name starts with it)
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_rate(rate: str) -> tuple[int, float]:
    """``(count, seconds)`` of a rate in Celery's syntax: at most ``count`` in any
    ``seconds``. ``"20/m"`` is 20 in 60 s; ``"0.5/s"`` is 1 in 2 s."""
    text = str(rate).strip()
    number, _, unit = text.partition("/")
    try:
        per = float(number)
        seconds = _UNITS[unit or "s"]
    except (ValueError, KeyError):
        raise ZKConfigurationError(
            f"{rate!r} is not a rate: write it as Celery's rate_limit is, a number of "
            "tasks per second, minute or hour (e.g. '20/m', '5/s', '100/h').") from None
    if not per > 0 or per != per or per == float("inf"):
        raise ZKConfigurationError(f"rate {rate!r} must be a positive, finite number per "
                                   "unit of time (to remove a limit, clear it).")
    if per >= 1:
        count = int(per)
        return count, seconds * count / per
    return 1, seconds / per


@dataclass(frozen=True)
class Limit:
    """One limit, as stored under ``limits/``."""

    kind: str                       # TASK or QUEUE
    name: str                       # the task's name, or the queue's
    rate: str | None = None
    concurrency: int | None = None
    key: str | None = None          # a template over the task's arguments

    def __post_init__(self) -> None:
        if self.rate is not None:
            parse_rate(self.rate)
        if self.concurrency is not None and (not isinstance(self.concurrency, int)
                                             or self.concurrency < 1):
            raise ZKConfigurationError(
                f"the concurrency limit of {self.name!r} must be a whole number of "
                f"tasks, at least 1 (got {self.concurrency!r}).")
        if self.kind == QUEUE and self.concurrency is not None:
            raise ZKConfigurationError(
                f"queue {self.name!r}: a queue takes a rate limit; concurrency limits "
                "are per task (zk_concurrency_limits).")

    @property
    def token(self) -> str | None:
        return task_token(self.name) if self.kind == TASK else None

    def data(self) -> bytes:
        fields = {"rate": self.rate, "concurrency": self.concurrency, "key": self.key}
        return json.dumps({k: v for k, v in fields.items() if v is not None}).encode()

    @classmethod
    def from_node(cls, kind: str, name: str, data: bytes) -> Limit | None:
        try:
            fields = json.loads(data or b"{}")
            return cls(kind, name, fields.get("rate"), fields.get("concurrency"),
                       fields.get("key"))
        except (ValueError, TypeError, AttributeError, ZKConfigurationError) as exc:
            logger.error("celery_zk: the limit %s %r in ZooKeeper is not valid (%s); it "
                         "is ignored until it is set again", kind, name, exc)
            return None


class LimitStore:
    """Reading and writing ``limits/`` (workers at start, ``celery zk limit``)."""

    def __init__(self, client: KazooClient, layout: Layout) -> None:
        self.client = client
        self.layout = layout

    def set(self, limit: Limit) -> None:
        client, path = self.client, self.layout.limit(limit.kind, limit.name)
        try:
            client.retry(client.create, path, limit.data(), makepath=True)
        except NodeExistsError:
            client.retry(client.set, path, limit.data())

    def clear(self, kind: str, name: str) -> bool:
        return delete_tree(self.client, self.layout.limit(kind, name))

    def all(self, watch: Any = None) -> list[Limit]:
        client = self.client
        try:
            names = client.retry(client.get_children, self.layout.limits, watch=watch)
        except NoNodeError:
            if watch is not None:   # watch for the first limit's directory
                client.retry(client.exists, self.layout.limits, watch=watch)
            return []
        parsed = [(p, name) for name in names if (p := self.layout.parse_limit_name(name))]
        reads = [(p, client.get_async(self.layout.limit(*p), watch=watch)) for p, _ in parsed]
        found = []
        for (kind, name), (data, _) in answered(reads):
            limit = Limit.from_node(kind, name, data)
            if limit is not None:
                found.append(limit)
        return found

    def given(self, limit: Limit) -> list[float]:
        """When the last messages under ``limit``'s rate were given (epoch seconds)."""
        try:
            data, _ = self.client.retry(self.client.get,
                                        self.layout.limit_given(limit.kind, limit.name))
            times = json.loads(data or b"[]")
        except (NoNodeError, ValueError):
            return []
        return [float(t) for t in times if isinstance(t, (int, float))]


def limit_tokens(message: dict[str, Any], limits: Iterable[Limit],
                 decode: Any) -> tuple[str | None, str | None]:
    """The task and concurrency-key tokens a kombu message's name carries.

    The key is the template of the task's keyed concurrency limit, filled from
    the task's arguments (``decode(message)``: ``(args, kwargs)``), or the
    ``zk_limit_key`` header a publisher set itself.
    """
    headers = message.get("headers") or {}
    task = headers.get("task")
    if not isinstance(task, str) or not task:
        return None, None
    key = headers.get(HEADER)
    template = next((lim.key for lim in limits if lim.kind == TASK and lim.name == task
                     and lim.concurrency and lim.key), None)
    if key is None and template:
        args, kwargs = decode(message)
        try:
            key = template.format(*args, **kwargs)
        except (IndexError, KeyError, ValueError, AttributeError) as exc:
            raise ZKConfigurationError(
                f"the concurrency limit of {task!r} is per key {template!r}, which "
                f"cannot be filled from this call's arguments ({exc!r}): name an argument "
                "the task is always called with, e.g. '{customer_id}' or '{0}', or set "
                "the key with `celery zk limit set`. Nothing was sent.") from None
    return task_token(task), limit_key_token(str(key)) if key is not None else None


# -- the app's configuration --------------------------------------------------------
def limit_target(name: str) -> tuple[str, str]:
    """``(kind, name)`` of what a limit is on: a task's name, or ``queue:NAME``."""
    kind, _, queue = name.partition("queue:")
    return (QUEUE, queue) if not kind and queue else (TASK, name)


def configured(conf: Any) -> list[Limit]:
    """The limits an app's configuration asks for (``zk_rate_limits``: task name,
    or ``"queue:NAME"``, to a rate; ``zk_concurrency_limits``: task name to a
    number, or to ``{"limit": N, "key": "{template}"}``)."""
    limits: dict[tuple[str, str], dict[str, Any]] = {}
    for name, rate in dict(conf.get("zk_rate_limits") or {}).items():
        limits.setdefault(limit_target(str(name)), {})["rate"] = str(rate)
    for name, value in dict(conf.get("zk_concurrency_limits") or {}).items():
        entry = limits.setdefault((TASK, str(name)), {})
        if isinstance(value, dict):
            entry["concurrency"], entry["key"] = value.get("limit"), value.get("key")
        else:
            entry["concurrency"] = value
    return [Limit(kind, name, **fields) for (kind, name), fields in limits.items()]


@worker_ready.connect(weak=False)
def _apply_configured(sender: Any = None, **_: Any) -> None:
    """A worker starting writes its app's limits (a restarted worker writes its
    configured values again over what ``celery zk limit`` set meanwhile)."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    limits = configured(app.conf)
    url = app.conf.broker_url or ""
    if not limits or not str(url).startswith("zk://"):
        return
    from ..zk.config import parse_url
    from ..zk.session import ClientHandle

    settings = parse_url(str(url), app.conf.get("broker_transport_options"))
    handle = ClientHandle(settings)
    try:
        store = LimitStore(handle.client, Layout(settings.root))
        for limit in limits:
            store.set(limit)
    finally:
        handle.close()


# -- what a dispatcher and publishers see ----------------------------------------------
class Book:
    """The limits under one root as one session sees them, followed by a watch
    (re-read by the next user after it fires; never on kazoo's thread)."""

    def __init__(self, client_of: Any, layout: Layout) -> None:
        self._client_of = client_of
        self.layout = layout
        self.limits: list[Limit] = []
        self._stale = True
        self._loaded = False
        self._lock = threading.Lock()
        self._listeners: list[Any] = []

    def listen(self, wake: Any) -> None:
        """``wake()`` (kazoo's thread) when a limit may have changed."""
        if wake not in self._listeners:
            self._listeners.append(wake)

    def _fired(self, _event: Any) -> None:   # kazoo's thread: flag and wake only
        self._stale = True
        for wake in list(self._listeners):
            wake()

    def current(self) -> list[Limit]:
        # Until the first load is done, every caller waits for it: a task
        # started meanwhile in another pool thread must see the limits too.
        if self._stale or not self._loaded:
            with self._lock:
                if self._stale or not self._loaded:
                    self._stale = False   # a watch firing during the load: load again
                    try:
                        self.limits = LimitStore(self._client_of(), self.layout).all(
                            watch=self._fired)
                    except Exception:
                        self._stale = True
                        raise
                    self._loaded = True
        return self.limits

    def holds(self, queue: str, task: str | None) -> bool:
        """Whether a message of ``task`` (its token) on ``queue`` may be limited."""
        return any((limit.kind == QUEUE and limit.name == queue)
                   or (limit.kind == TASK and limit.token == task)
                   for limit in self.current())


def book_for(session: Any, layout: Layout) -> Book:
    """The limits under ``layout``'s root, as ``session`` (a SharedSession) follows
    them: one per session, shared by its publishers and dispatchers."""
    return session.singleton(("limits", layout.root),
                             lambda: Book(lambda: session.client, layout))
