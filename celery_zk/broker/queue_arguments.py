"""A queue's arguments, as RabbitMQ names them (``x-max-length``, ...).

kombu turns ``Queue(max_length=..., message_ttl=..., expires=...)`` into
arguments only for a transport that asks it to (a virtual transport's
default drops them), so the transport asks, as py-amqp's does. They are
stored with the queue at its first declaration, so every process applies the
same, and a later declaration cannot change them; any argument not honoured
is named in one warning per queue and process, so a limit or a lifetime
never stops working in silence. See ``docs/configuration.md``, "Queue
arguments".
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

from ..exceptions import ZKConfigurationError
from ..zk.client import json_object

__all__ = ["DROP_HEAD", "REJECT_PUBLISH", "Limits", "expired", "meta", "read_meta",
           "warn_unhonoured"]

logger = logging.getLogger(__name__)

DROP_HEAD, REJECT_PUBLISH = "drop-head", "reject-publish"
#: reject-publish-dlx: refused as reject-publish (the publisher keeps the message).
_OVERFLOWS = {DROP_HEAD: DROP_HEAD, REJECT_PUBLISH: REJECT_PUBLISH,
              "reject-publish-dlx": REJECT_PUBLISH}
STORED = ("x-message-ttl", "x-max-length", "x-max-length-bytes", "x-overflow", "x-expires")
HONOURED = frozenset({"x-max-priority", *STORED})
_warned: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Limits:
    """What a queue's stored arguments ask of every publisher and consumer."""

    message_ttl: float | None = None   # seconds
    max_length: int | None = None
    max_length_bytes: int | None = None   # of the bodies waiting
    overflow: str = DROP_HEAD
    expires: float | None = None   # seconds unused before the queue goes
    temporary: bool = False   # auto-delete: goes with its session (the budget lets it by)

    @classmethod
    def of(cls, queue: str, arguments: dict[str, Any]) -> Limits:
        """From declared arguments; a bad value is a clear error before anything is stored."""
        def number(name: str) -> int | None:
            value = arguments.get(name)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ZKConfigurationError(
                    f"Queue {queue!r}: {name} must be a whole number of at least 0 (as "
                    f"RabbitMQ requires), not {value!r}. Nothing was declared.")
            return value
        ttl, length = number("x-message-ttl"), number("x-max-length")
        length_bytes, expires = number("x-max-length-bytes"), number("x-expires")
        overflow = arguments.get("x-overflow", DROP_HEAD)
        if overflow not in _OVERFLOWS:
            raise ZKConfigurationError(
                f"Queue {queue!r}: x-overflow must be one of {', '.join(_OVERFLOWS)}, not "
                f"{overflow!r}. Nothing was declared.")
        if expires == 0:
            raise ZKConfigurationError(
                f"Queue {queue!r}: x-expires must be at least 1 (milliseconds unused before "
                "the queue goes, as RabbitMQ requires), not 0. Nothing was declared.")
        return cls(None if ttl is None else ttl / 1000, length, length_bytes,
                   _OVERFLOWS[overflow], None if expires is None else expires / 1000)

    @classmethod
    def stored(cls, data: bytes) -> Limits:
        """From a queue node's data (a queue declared before 0.4 has no arguments)."""
        temporary, arguments = read_meta(data)
        try:
            return dataclasses.replace(cls.of("", arguments), temporary=temporary)
        except ZKConfigurationError:
            return cls(temporary=temporary)


def meta(arguments: Any, auto_delete: bool) -> bytes:
    """A queue node's data: whether it is auto-delete, and its stored arguments."""
    kept = {name: value for name, value in dict(arguments or {}).items() if name in STORED}
    return json.dumps({"auto_delete": auto_delete, "arguments": kept}).encode()


def read_meta(data: bytes) -> tuple[bool, dict[str, Any]]:
    """What :func:`meta` wrote: whether the queue is auto-delete, and its
    stored arguments (damaged data: neither)."""
    fields = json_object(data)
    arguments = fields.get("arguments")
    return bool(fields.get("auto_delete")), arguments if isinstance(arguments, dict) else {}


def expired(properties: dict[str, Any], stored_at: float | None, ttl: float | None,
            now: float) -> str | None:
    """Why a message stored at ``stored_at`` (the server's clock, seconds) is
    expired by ``now``, or None: the queue's ``ttl`` or its own ``expiration``
    (milliseconds, as AMQP and kombu give it), whichever ends first."""
    if stored_at is None:
        return None
    reasons = []
    if ttl is not None and now >= stored_at + ttl:
        reasons.append(f"the queue's x-message-ttl of {ttl * 1000:g} ms")
    try:
        own = float(properties.get("expiration") or "nan") / 1000
    except (TypeError, ValueError):
        own = float("nan")
    if own == own and now >= stored_at + own:   # not nan
        reasons.append(f"its expiration of {own * 1000:g} ms")
    return " and ".join(reasons) or None


def warn_unhonoured(queue: str, arguments: Any) -> None:
    """One warning per queue and argument this process declares with an
    argument celery_zk does not honour."""
    unhonoured = sorted(name for name in dict(arguments or {})
                        if name not in HONOURED and (queue, name) not in _warned)
    if not unhonoured:
        return
    _warned.update((queue, name) for name in unhonoured)
    logger.warning("celery_zk: queue %r is declared with %s, which celery_zk does not honour "
                   "yet: the queue works without it (docs/configuration.md, 'Queue arguments'). "
                   "Remove it from the declaration to silence this.",
                   queue, ", ".join(unhonoured))


def warn_kept(queue: str, declared: Limits, kept: Limits) -> None:
    """A declaration whose limits differ from those stored with the queue."""
    if dataclasses.replace(kept, temporary=declared.temporary) != declared and (
            queue, "") not in _warned:
        _warned.add((queue, ""))
        logger.warning("celery_zk: queue %r was declared with %s, but it exists with %s, "
                       "which stay (as RabbitMQ, a declaration does not change a queue's "
                       "arguments). Delete the queue to declare it anew.", queue,
                       declared, kept)
