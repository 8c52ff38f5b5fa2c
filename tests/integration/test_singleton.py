"""Singleton tasks on a session-bound lock (celery_zk.features.singleton), on real servers
and real workers: no TTL, released by ZooKeeper when the holder dies."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient

from celery_zk.zk.layout import Layout

from .workers import Worker, read_log, run_example, wait_until

LAYOUT = Layout("/")  # zk_client is chrooted at the URL's path


@contextmanager
def client_app(url: str) -> Iterator[Celery]:
    app = Celery("client", broker=url, backend=url, set_as_current=False)
    try:
        yield app
    finally:
        app.close()


def runs(task_log: Path) -> list[list[Any]]:
    """[key, started, ended, token, held at start, held at end] of each run."""
    return sorted((entry["value"] for entry in read_log(task_log)
                   if entry["kind"] == "single"), key=lambda run: run[1])


def test_two_workers_and_100_calls_never_run_two_at_once(
        zk_url: str, start_worker: Callable[..., Worker], task_log: Path) -> None:
    start_worker(zk_url, backend=zk_url, log=task_log, name="a", concurrency=4)
    start_worker(zk_url, backend=zk_url, log=task_log, name="b", pool="prefork",
                 concurrency=4)
    with client_app(zk_url) as app:
        results = [app.send_task("proj.app.single_wait", args=("shared", 0.02))
                   for _ in range(100)]
        for result in results:
            result.get(timeout=180)
    done = runs(task_log)
    assert len(done) == 100
    for before, after in zip(done, done[1:]):
        assert after[1] >= before[2], f"two runs at once: {before} and {after}"
        assert after[3] > before[3]   # the fencing token only grows
    assert all(run[4] and run[5] for run in done)   # lock_held() inside every run
    pids = {entry["pid"] for entry in read_log(task_log)}
    assert len(pids) >= 2   # both workers took part


def test_a_second_call_while_the_lock_is_held_fails_and_names_the_holder(
        zk_url: str, zk_client: KazooClient, start_worker: Callable[..., Worker],
        task_log: Path) -> None:
    start_worker(zk_url, backend=zk_url, log=task_log, concurrency=2)
    with client_app(zk_url) as app:
        first = app.send_task("proj.app.single_skip", args=("busy", 3.0))
        wait_until(lambda: zk_client.exists(LAYOUT.lock("single-busy")) is not None, 30)
        second = app.send_task("proj.app.single_skip", args=("busy",))
        with pytest.raises(Exception) as failure:
            second.get(timeout=30)
        assert type(failure.value).__name__ == "LockHeld"
        assert f"is held by task {first.id}" in str(failure.value)
        assert second.state == "FAILURE"
        other = app.send_task("proj.app.single_skip", args=("other-key",))
        assert other.get(timeout=30)[0] == "other-key"   # another key: its own lock
        assert first.get(timeout=30)[0] == "busy"


def test_kill_9_of_the_holder_frees_the_lock_within_the_session_timeout(
        zk_url: str, zk_client: KazooClient, start_worker: Callable[..., Worker],
        task_log: Path) -> None:
    url = f"{zk_url}?session_timeout=4"
    holder = start_worker(url, backend=url, log=task_log, name="holder", concurrency=1)
    lock = LAYOUT.lock("single-crash")
    with client_app(url) as app:
        app.send_task("proj.app.single_skip", args=("crash", 120.0))
        wait_until(lambda: zk_client.exists(lock) is not None, 30)
        assert holder.proc is not None
        os.killpg(holder.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        # The server expires sessions a tick (2 s by default) at a time, so up to
        # timeout + tick after the last ping: 6 s here on an idle machine, and CI's
        # loaded one once took longer. What this shows is that the session frees
        # the lock, long before the task's 120 s would have: hence the margin.
        wait_until(lambda: zk_client.exists(lock) is None, 4 + 2 + 6,
                   message="the dead holder's lock outlived its session timeout (4 s) + "
                           "a tick (2 s) + 6 s: its session did not free it")
        freed_after = time.monotonic() - killed
        start_worker(url, backend=url, log=task_log, name="next", concurrency=1)
        after = app.send_task("proj.app.single_skip", args=("crash",))
        assert after.get(timeout=60)[0] == "crash"
    print(f"lock freed {freed_after:.1f} s after kill -9 (session timeout 4 s)")


def test_a_holder_that_runs_longer_than_any_timeout_keeps_its_lock(
        zk_url: str, zk_client: KazooClient, start_worker: Callable[..., Worker],
        task_log: Path) -> None:
    url = f"{zk_url}?session_timeout=4"
    start_worker(url, backend=url, log=task_log, concurrency=2)
    lock = LAYOUT.lock("single-long")
    with client_app(url) as app:
        long = app.send_task("proj.app.single_skip", args=("long", 14.0))
        wait_until(lambda: zk_client.exists(lock) is not None, 30)
        token = zk_client.exists(lock).czxid
        for _ in range(3):   # 3 × 4 s: three session timeouts, still held
            time.sleep(4)
            stat = zk_client.exists(lock)
            assert stat is not None and stat.czxid == token
            intruder = app.send_task("proj.app.single_skip", args=("long",))
            with pytest.raises(Exception, match="is held by task"):
                intruder.get(timeout=30)
        key, _, _, run_token, held_at_start, held_at_end = long.get(timeout=60)
        assert (key, run_token, held_at_start, held_at_end) == ("long", token, True, True)
    assert zk_client.exists(lock) is None   # released when it returned


def test_the_singleton_example_runs() -> None:
    proc = run_example("singleton")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "second call: LockHeld" in proc.stdout and "report for globex" in proc.stdout
