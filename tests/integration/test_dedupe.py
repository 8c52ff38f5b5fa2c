"""Celery's worker_deduplicate_successful_tasks on zk://: a task whose worker died
after it succeeded but before its late ack landed is not run again.

It needs ``task_acks_late``, a result backend, and ``delivery_info['redelivered']``
on the message that comes back: celery_zk marks every message requeued from a
dead owner so (the name says it was requeued).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from celery import Celery

from .workers import Worker, executed_values, run_example, wait_until


@pytest.mark.parametrize("deduplicate", [True, False])
def test_a_task_that_succeeded_before_its_worker_died_runs_once(
        zk_url: str, start_worker: Callable[..., Worker], task_log: Path,
        deduplicate: bool) -> None:
    url = f"{zk_url}?session_timeout=4"   # the dead worker's messages come back in 4 s
    conf = {"CELERY_ZK_TEST_CONF": json.dumps({
        "task_acks_late": True, "worker_deduplicate_successful_tasks": deduplicate,
        "worker_prefetch_multiplier": 4})}
    doomed = start_worker(url, backend=url, log=task_log, name="doomed", concurrency=1,
                          env={**conf, "CELERY_ZK_TEST_DIE_AFTER_SUCCESS": "1"})
    client = Celery("client", broker=url, backend=url, set_as_current=False)
    try:
        results = [client.send_task("proj.app.record", args=(f"v{i}",)) for i in range(3)]
        assert doomed.proc is not None
        wait_until(lambda: doomed.proc.poll() is not None, 30,
                   message="the worker did not die after its first task")
        assert executed_values(task_log) == {"v0": 1}   # stored, never acked
        assert results[0].get(timeout=10) == "v0"
        survivor = start_worker(url, backend=url, log=task_log, name="survivor",
                                concurrency=2, env=conf)
        assert [r.get(timeout=60) for r in results[1:]] == ["v1", "v2"]
        wait_until(lambda: sum(executed_values(task_log).values()) >= 3 + (not deduplicate),
                   30, message=f"executed: {executed_values(task_log)}")
        if deduplicate:
            wait_until(lambda: "Task already completed successfully" in survivor.output(), 30,
                       message=survivor.output()[-3000:])
            assert executed_values(task_log) == {"v0": 1, "v1": 1, "v2": 1}
        else:   # the control: without the setting it runs again (at-least-once)
            assert executed_values(task_log) == {"v0": 2, "v1": 1, "v2": 1}
    finally:
        client.close()


def test_the_dedupe_example_runs() -> None:
    proc = run_example("dedupe")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "charges made: 1" in proc.stdout
