"""The opt-in ``cloudpickle`` serializer.

kombu registers every ``kombu.serializers`` entry point at import time, but a
registered serializer is only *accepted* when the application lists it in
``accept_content`` (and used when it is ``task_serializer``). cloudpickle, like
pickle, runs arbitrary code on load: accept it only from publishers you trust,
and pair it with digest ACLs so nobody else can write to your queues.
"""
from __future__ import annotations

from typing import Any

import cloudpickle

CONTENT_TYPE = "application/x-cloudpickle"


def _loads(data: bytes | str) -> Any:
    if isinstance(data, str):  # kombu hands text back for some body encodings
        data = data.encode("latin-1")
    return cloudpickle.loads(data)


#: (encoder, decoder, content_type, content_encoding), as kombu's register() takes them.
register_args = (cloudpickle.dumps, _loads, CONTENT_TYPE, "binary")
