"""Dead letters: the reason line a dead node keeps before the message.

The dead node keeps the message's bytes unchanged behind one header line::

    \\0celery_zk-dead {"reason": "...", "at": 1763900000.1, "host": "w1", "pid": 42}\\n
    <the message as it was stored>

The leading NUL keeps the header from ever being mistaken for a message.
Dead nodes written before reasons were kept have no header and show the
reason as unknown. Listing, requeueing and purging them is
:mod:`celery_zk.ops.dead_letters`. See ``docs/design.md``, "Message
lifecycle", and ``docs/operations.md``, "Dead letters".
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

__all__ = ["MAGIC", "UNKNOWN", "unwrap", "wrap"]

MAGIC = b"\0celery_zk-dead "
UNKNOWN = "unknown (dead-lettered before celery_zk kept reasons)"


def wrap(data: bytes, reason: str) -> bytes:
    """A dead node's data: the header line, then ``data`` unchanged."""
    header = {"reason": reason, "at": round(time.time(), 3),
              "host": socket.gethostname(), "pid": os.getpid()}
    return MAGIC + json.dumps(header, ensure_ascii=True).encode() + b"\n" + data


def unwrap(data: bytes) -> tuple[dict[str, Any], bytes]:
    """``(header, original data)`` of a dead node (an empty header if it has none)."""
    if not data.startswith(MAGIC):
        return {}, data
    line, _, rest = data[len(MAGIC):].partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError:
        return {}, data
    return (header, rest) if isinstance(header, dict) else ({}, data)
