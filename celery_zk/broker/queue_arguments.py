"""A queue's arguments, as RabbitMQ names them (``x-max-length``, ...).

kombu turns ``Queue(max_length=..., message_ttl=..., expires=...)`` into
arguments only for a transport that asks it to (a virtual transport's
default drops them), so the transport asks, as py-amqp's does, and every
argument reaches :func:`warn_unhonoured`. celery_zk honours
``x-max-priority`` in effect (every queue has priorities 0-9), and on an
auto-delete or exclusive queue ``x-expires`` and ``x-message-ttl`` (the queue
and what it holds go with the session that declared it: kombu's remote
control and Celery's event queues set both); any other is named in one
warning per queue and process, so a limit or a lifetime never stops working
in silence.
"""
from __future__ import annotations

import logging
from typing import Any

from kombu.transport.base import to_rabbitmq_queue_arguments

__all__ = ["HONOURED", "HONOURED_BY_TEMPORARY", "prepare", "warn_unhonoured"]

logger = logging.getLogger(__name__)

HONOURED = frozenset({"x-max-priority"})
HONOURED_BY_TEMPORARY = HONOURED | {"x-expires", "x-message-ttl"}
_warned: set[tuple[str, str]] = set()


def prepare(arguments: Any, **options: Any) -> dict[str, Any]:
    """``Queue``'s keyword options as RabbitMQ's arguments, beside ``arguments``."""
    return to_rabbitmq_queue_arguments(arguments, **options)


def warn_unhonoured(queue: str, arguments: Any, temporary: bool) -> None:
    """One warning per queue and argument this process declares with an
    argument celery_zk does not honour; ``temporary``: an auto-delete or
    exclusive queue."""
    honoured = HONOURED_BY_TEMPORARY if temporary else HONOURED
    unhonoured = sorted(name for name in dict(arguments or {})
                        if name not in honoured and (queue, name) not in _warned)
    if not unhonoured:
        return
    _warned.update((queue, name) for name in unhonoured)
    logger.warning("celery_zk: queue %r is declared with %s, which celery_zk does not honour "
                   "yet: the queue works without it (docs/configuration.md, 'Queue arguments'). "
                   "Remove it from the declaration to silence this.",
                   queue, ", ".join(unhonoured))
