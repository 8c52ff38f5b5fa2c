"""Counting a kazoo client's calls, for tests that assert which requests were made."""
from __future__ import annotations

from typing import Any

import pytest

from celery_zk.zk.multi import Multi

#: The client methods a consumer reads and claims with.
CONSUMER_REQUESTS = ("get_children", "get", "exists", "get_async", "transaction")


def count_calls(monkeypatch: pytest.MonkeyPatch, client: Any, *names: str) -> list[str]:
    """The names of ``client``'s methods ``names`` as they are called, in order;
    a :class:`~celery_zk.zk.multi.Multi` committed on ``client`` counts as a
    ``transaction`` (the hot multis are built with it, not with kazoo's)."""
    calls: list[str] = []
    if "transaction" in names:
        real_commit = Multi.commit_async

        def commit_async(multi: Multi) -> Any:
            if multi.client is client:
                calls.append("transaction")
            return real_commit(multi)
        monkeypatch.setattr(Multi, "commit_async", commit_async)
    for name in names:
        real = getattr(client, name)

        def call(*args: Any, __real: Any = real, __name: str = name, **kwargs: Any) -> Any:
            calls.append(__name)
            return __real(*args, **kwargs)
        monkeypatch.setattr(client, name, call)
    return calls
