"""Where a task starts: whether its process asks ZooKeeper for the rate limits.

A prefork child that asked made a session of its own for it; told by the
parent that no rate limit was known (``RATE_LIMITED`` False), it asks nothing.
A task not delivered by celery_zk (eager, another broker) is looked at as before.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_zk.features import limit_gate
from celery_zk.features.limits import Limit


def started(properties: dict[str, Any] | None) -> list[Any]:
    """The apps whose limits the start looked up."""
    app = Celery("gate", set_as_current=False)
    request = SimpleNamespace(delivery_info={"routing_key": "celery"})
    if properties is not None:
        request.properties = properties
    task = SimpleNamespace(app=app, name="proj.tasks.t", request=request)
    looked: list[Any] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(limit_gate, "_limits_of", lambda a: looked.append(a))
        limit_gate._before_a_task_starts(task=task)
    return looked


def test_a_task_delivered_with_no_rate_limit_known_looks_up_nothing() -> None:
    assert started({limit_gate.RATE_LIMITED: False}) == []


@pytest.mark.parametrize("properties", [
    {limit_gate.RATE_LIMITED: True},
    {},                                 # delivered by another broker
    None,                               # no properties at all (run eagerly)
], ids=["rate-limit-known", "no-mark", "no-properties"])
def test_any_other_start_looks_the_limits_up(properties: dict[str, Any] | None) -> None:
    assert len(started(properties)) == 1


def test_only_a_rate_marks_a_delivery() -> None:
    assert limit_gate.rate_limited([Limit("t", "a", rate="5/s")])
    assert not limit_gate.rate_limited([Limit("t", "a", concurrency=2)])
    assert not limit_gate.rate_limited([])
