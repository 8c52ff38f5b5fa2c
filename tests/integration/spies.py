"""Counting a kazoo client's calls, for tests that assert which requests were made."""
from __future__ import annotations

from typing import Any

import pytest

#: The client methods a consumer reads and claims with.
CONSUMER_REQUESTS = ("get_children", "get", "exists", "get_async", "transaction")


def count_calls(monkeypatch: pytest.MonkeyPatch, client: Any, *names: str) -> list[str]:
    """The names of ``client``'s methods ``names`` as they are called, in order."""
    calls: list[str] = []
    for name in names:
        real = getattr(client, name)

        def call(*args: Any, __real: Any = real, __name: str = name, **kwargs: Any) -> Any:
            calls.append(__name)
            return __real(*args, **kwargs)
        monkeypatch.setattr(client, name, call)
    return calls


def count_multis(monkeypatch: pytest.MonkeyPatch, client: Any) -> list[int]:
    """The size of each ``multi`` ``client`` sends, kazoo's transactions and
    celery_zk's ``Multi`` alike: both go through kazoo's request queue."""
    from kazoo.protocol.serialization import Transaction

    sizes: list[int] = []
    real = client._call

    def call(request: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(request, Transaction):
            sizes.append(len(request.operations))
        return real(request, *args, **kwargs)
    monkeypatch.setattr(client, "_call", call)
    return sizes


def count_assignments(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """``(messages given, refused)`` of each assignment multi this process's
    dispatchers send, as they learn its outcome."""
    from celery_zk.broker import dispatcher

    seen: list[tuple[int, bool]] = []
    real = dispatcher.settle

    def settle(done: Any, results: list[Any]) -> Any:
        refused = real(done, results)
        seen.append((sum(map(len, done.given().values())), refused is not None))
        return refused
    monkeypatch.setattr(dispatcher, "settle", settle)
    return seen
