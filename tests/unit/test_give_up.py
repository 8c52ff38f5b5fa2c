"""celery_zk.zk.background.give_up_when_cut_off: when a shutting-down process
gives a cut-off session up (the decision; the worker-level behaviour is in
tests/integration/test_faults.py)."""
from __future__ import annotations

from typing import Any

import pytest
from kazoo.client import KazooClient

from celery_zk.zk import background as release
from celery_zk.zk import session as sessions
from celery_zk.zk.config import parse_url


@pytest.fixture
def cut_off(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A session whose client never connected (to a port nobody listens on)."""
    settings = parse_url(["zk://127.0.0.1:1/give-up"], {})
    shared = sessions.SharedSession(sessions.session_key(settings), settings)
    shared._client = KazooClient(hosts="127.0.0.1:1")   # made, never started
    return shared


def test_a_cut_off_session_is_given_up_after_the_grace(cut_off: Any) -> None:
    since: dict[Any, float] = {}
    release._give_up_cut_off(since, [cut_off], now=100.0)
    release._give_up_cut_off(since, [cut_off], now=100.0 + release.SHUTDOWN_GRACE - 0.1)
    assert not cut_off.given_up
    release._give_up_cut_off(since, [cut_off], now=100.0 + release.SHUTDOWN_GRACE)
    assert cut_off.given_up


def test_nothing_is_given_up_while_a_task_runs(cut_off: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A threads worker's running task stores its result and sends its ack
    through the session: given up under it, the result would be lost."""
    running = [True]
    monkeypatch.setattr(release, "_busy", lambda: running[0])
    since: dict[Any, float] = {}
    for now in (100.0, 110.0, 200.0):
        release._give_up_cut_off(since, [cut_off], now=now)
    assert not cut_off.given_up
    running[0] = False   # the last task ended: the grace starts now
    release._give_up_cut_off(since, [cut_off], now=201.0)
    release._give_up_cut_off(since, [cut_off], now=201.0 + release.SHUTDOWN_GRACE - 0.1)
    assert not cut_off.given_up
    release._give_up_cut_off(since, [cut_off], now=201.0 + release.SHUTDOWN_GRACE)
    assert cut_off.given_up
