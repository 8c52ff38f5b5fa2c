"""kombu's private names that celery_zk's transport uses (kombu 5.3 to 5.7).

A kombu virtual transport is written by subclassing ``virtual.Channel`` and
``virtual.QoS`` and overriding their underscore methods (``_get``, ``_put``,
``_size`` ...): every kombu transport does, and :data:`CHANNEL_HOOKS` lists
the ones celery_zk overrides. Beyond those, the transport reads a few of
kombu's internals, each through a function here:

* the QoS's ``_delivered`` / ``_dirty`` / ``_flush`` / ``_quick_ack``: what is
  delivered and not yet acked, to requeue it on close and to count the
  prefetch window;
* the QoS's ``_on_collect`` exit hook, cancelled so a dropped Connection can
  be garbage-collected (and give back its share of the session);
* the channel's ``_active_queues`` / ``_tag_to_queue`` and
  ``_get_message_priority``; the Transport's ``_deliver``.

No fallback exists for these: :func:`require` makes the transport refuse to
start, naming what is missing, rather than fail later in the middle of a
delivery.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kombu.transport import virtual

from . import PrivateAPIChanged, describe

__all__ = ["CHANNEL_HOOKS", "consumed_queues", "deliver_callback", "drain_delivered",
           "forget_at_exit", "lookup", "missing", "priority_of", "queue_of", "require",
           "settle", "unacked"]

#: The underscore methods of ``virtual.Channel`` celery_zk's Channel overrides.
CHANNEL_HOOKS = ("_get", "_put", "_new_queue", "_has_queue", "_size", "_purge", "_lookup")
#: The hooks kombu calls without defining them (fanout support): ``(hook, the
#: kombu method that calls it)``.
FANOUT_HOOKS = (("_queue_bind", "kombu.transport.virtual.base:Channel.queue_bind"),
                ("_put_fanout", "kombu.transport.virtual.exchange:FanoutExchange.deliver"))
#: Methods of ``virtual.Channel``, ``virtual.QoS`` and ``virtual.Transport`` called here.
CHANNEL_METHODS = ("_get_message_priority", "_lookup")
QOS_METHODS = ("_flush",)
TRANSPORT_METHODS = ("_deliver",)
#: Attributes set by ``__init__``: checked on an instance.
QOS_ATTRIBUTES = ("_delivered", "_dirty", "_on_collect", "_quick_ack")
CHANNEL_ATTRIBUTES = ("_active_queues", "_tag_to_queue")

_checked = False


def _changed(name: str) -> PrivateAPIChanged:
    return PrivateAPIChanged(describe(
        "kombu", name, "as every kombu virtual transport does",
        "The zk:// transport cannot run on this kombu."))


def missing(channel: Any = None) -> list[str]:
    """What the installed kombu lacks, one message each (with ``channel``, an
    open zk:// channel, its and its QoS's attributes too)."""
    problems = [f"virtual.Channel.{name}" for name in (*CHANNEL_HOOKS, *CHANNEL_METHODS)
                if not callable(getattr(virtual.Channel, name, None))]
    problems += [f"virtual.QoS.{name}" for name in QOS_METHODS
                 if not callable(getattr(virtual.QoS, name, None))]
    problems += [f"virtual.Transport.{name}" for name in TRANSPORT_METHODS
                 if not callable(getattr(virtual.Transport, name, None))]
    for hook, caller in FANOUT_HOOKS:
        source = _source(caller)
        if source is not None and hook not in source:   # unreadable source: cannot tell
            problems.append(f"{caller.partition(':')[2]} calling channel.{hook}")
    if channel is not None:
        problems += [f"virtual.Channel().{name}" for name in CHANNEL_ATTRIBUTES
                     if not hasattr(channel, name)]
        problems += [f"virtual.QoS().{name}" for name in QOS_ATTRIBUTES
                     if not hasattr(channel.qos, name)]
    return [str(_changed(name)) for name in problems]


def _source(target: str) -> str | None:
    """The source of ``module:Class.method`` ("" when it is gone, None when it
    cannot be read)."""
    import importlib
    import inspect

    module, _, path = target.partition(":")
    owner: Any = importlib.import_module(module)
    for name in path.split("."):
        owner = getattr(owner, name, None)
    if owner is None:
        return ""
    try:
        return inspect.getsource(owner)
    except (OSError, TypeError):
        return None


def require() -> None:
    """Raise :class:`PrivateAPIChanged` unless the installed kombu has every
    class-level name above (checked once per process)."""
    global _checked
    if _checked:
        return
    problems = missing()
    if problems:
        raise PrivateAPIChanged("\n".join(problems))
    _checked = True


# -- the QoS ----------------------------------------------------------------------
def forget_at_exit(qos: virtual.QoS) -> None:
    """Cancel the exit hook kombu registers for ``qos``; it would keep the
    channel and its transport alive until the interpreter exits."""
    qos._on_collect.cancel()


def unacked(qos: virtual.QoS) -> int:
    """Messages delivered and not yet acked or rejected."""
    return len(qos._delivered) - len(qos._dirty)  # type: ignore[arg-type]


def settle(qos: virtual.QoS, delivery_tag: str) -> None:
    """Forget ``delivery_tag`` without acking it again (it was rejected)."""
    qos._quick_ack(delivery_tag)


def drain_delivered(qos: virtual.QoS) -> Iterator[tuple[str, Any, bool]]:
    """Take every message delivered and not acked: ``(tag, message, settled)``,
    ``settled`` when an ack or reject of it was already under way."""
    qos._flush()
    pending = qos._delivered
    while pending:
        tag, message = pending.popitem()
        yield tag, message, tag in qos._dirty


# -- the channel and its messages -------------------------------------------------
def consumed_queues(channel: virtual.Channel) -> set[str]:
    """The queues ``channel`` consumes from."""
    return channel._active_queues


def queue_of(channel: virtual.Channel, consumer_tag: str) -> str | None:
    """The queue consumer ``consumer_tag`` of ``channel`` consumes."""
    return channel._tag_to_queue.get(consumer_tag)


def priority_of(channel: virtual.Channel, message: dict[str, Any]) -> int:
    """A message's priority as kombu reads it (0-9, clamped)."""
    return channel._get_message_priority(message)


def lookup(channel: virtual.Channel, exchange: str, routing_key: str,
           default: Any = None) -> list[str]:
    """kombu's own routing-table lookup (the one celery_zk's Channel extends)."""
    return virtual.Channel._lookup(channel, exchange, routing_key,
                                   default)


def deliver_callback(transport: virtual.Transport) -> Callable[..., Any]:
    """The transport's delivery callback for ``transport.cycle.get``."""
    return transport._deliver
