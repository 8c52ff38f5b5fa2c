"""Durable revokes (celery_zk.features.revokes): a revoke outlives the workers alive when
it was sent, on real servers and real workers (prefork); a thread pool honours a revoke
that came while a task waited in it."""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery
from kazoo.client import KazooClient

from celery_zk.zk.layout import Layout

from .workers import Worker, celery_cli, executed_values, run_example, wait_until

LAYOUT = Layout("/")  # zk_client is chrooted at the URL's path


def inspect_revoked(url: str) -> list[str]:
    done = celery_cli(["inspect", "revoked", "--json"], url)
    assert done.returncode == 0, done.stderr
    return [task_id for ids in json.loads(done.stdout).values() for task_id in ids]


def test_a_revoke_sent_while_no_worker_runs_is_honoured_after_start_and_restart(
        zk_url: str, zk_client: KazooClient, start_worker: Callable[..., Worker],
        task_log: Path) -> None:
    client = Celery("client", broker=zk_url, backend=zk_url, set_as_current=False)
    try:
        doomed = client.send_task("proj.app.record", args=("revoked",))
        kept = client.send_task("proj.app.record", args=("kept",))
        client.control.revoke(doomed.id)   # no worker is running: nobody hears it
        assert zk_client.exists(LAYOUT.revoked_task(doomed.id))
        worker = start_worker(zk_url, backend=zk_url, log=task_log, pool="prefork",
                              concurrency=2)
        assert kept.get(timeout=60) == "kept"
        wait_until(lambda: doomed.state == "REVOKED", 30,
                   message=f"state {doomed.state}; worker:\n{worker.output()[-3000:]}")
        assert executed_values(task_log) == {"kept": 1}
        assert doomed.id in inspect_revoked(zk_url)
        worker.stop()
        # Restarted: still revoked, and a message of that id is not run either.
        worker = start_worker(zk_url, backend=zk_url, log=task_log, pool="prefork",
                              concurrency=2, name="again")
        assert doomed.id in inspect_revoked(zk_url)
        again = client.send_task("proj.app.record", args=("revoked",), task_id=doomed.id)
        after = client.send_task("proj.app.record", args=("after",))
        assert after.get(timeout=60) == "after"
        wait_until(lambda: again.state == "REVOKED", 30)
        assert executed_values(task_log) == {"kept": 1, "after": 1}
    finally:
        client.close()


def test_revokes_by_stamped_headers_are_kept_too(
        zk_url: str, start_worker: Callable[..., Worker], task_log: Path) -> None:
    client = Celery("client", broker=zk_url, backend=zk_url, set_as_current=False)
    try:
        stamped = client.signature("proj.app.record", args=("stamped",))
        stamped.stamp(batch="b-7")
        doomed = stamped.apply_async()
        plain = client.send_task("proj.app.record", args=("plain",))
        client.control.revoke_by_stamped_headers({"batch": "b-7"})
        start_worker(zk_url, backend=zk_url, log=task_log, concurrency=2)
        assert plain.get(timeout=60) == "plain"
        wait_until(lambda: doomed.state == "REVOKED", 30, message=doomed.state)
        assert executed_values(task_log) == {"plain": 1}
    finally:
        client.close()


def test_a_revoke_for_named_workers_only_is_not_kept(
        zk_url: str, zk_client: KazooClient) -> None:
    client = Celery("client", broker=zk_url, set_as_current=False)
    try:
        client.control.revoke("some-task", destination=["w1@nowhere"])
        client.control.revoke("all-task")
    finally:
        client.close()
    assert zk_client.exists(LAYOUT.revoked_task("all-task"))
    assert not zk_client.exists(LAYOUT.revoked_task("some-task"))


def test_an_expired_revoke_is_dropped_when_a_worker_loads_them(
        zk_url: str, zk_client: KazooClient, start_worker: Callable[..., Worker]) -> None:
    old = LAYOUT.revoked_task("ancient")
    zk_client.create(old, json.dumps({"at": 1.0, "task_id": "ancient"}).encode(),
                     makepath=True)
    fresh: Any = LAYOUT.revoked_task("fresh")
    client = Celery("client", broker=zk_url, set_as_current=False)
    try:
        client.control.revoke("fresh")
    finally:
        client.close()
    start_worker(zk_url)
    wait_until(lambda: zk_client.exists(old) is None, 30)
    assert zk_client.exists(fresh)
    assert "fresh" in inspect_revoked(zk_url) and "ancient" not in inspect_revoked(zk_url)


def test_the_durable_revokes_example_runs() -> None:
    proc = run_example("durable_revokes")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "unwanted: REVOKED" in proc.stdout and "wanted: wanted" in proc.stdout


def test_a_task_revoked_while_it_waits_in_a_thread_pool_does_not_start(
        zk_url: str, start_worker: Callable[..., Worker], task_log: Path) -> None:
    """Celery's thread pool takes every task it is handed into its executor at
    once and checks the revoked set only then; a task waiting there behind a
    long one started even though its revoke had arrived (celery_zk asks again
    right before the start). State REVOKED, as for one revoked before."""
    worker = start_worker(zk_url, backend=zk_url, log=task_log, pool="threads",
                          concurrency=1)
    client = Celery("client", broker=zk_url, backend=zk_url, set_as_current=False)
    try:
        long = client.send_task("proj.app.slow_record", args=("long", 4))
        wait_until(lambda: long.id in worker.output(), 30,
                   message=f"the long task was never received:\n{worker.output()[-3000:]}")
        doomed = client.send_task("proj.app.record", args=("revoked-while-waiting",))
        wait_until(lambda: doomed.id in worker.output(), 30,
                   message=f"the worker never received it:\n{worker.output()[-3000:]}")
        client.control.revoke(doomed.id)
        wait_until(lambda: f"Tasks flagged as revoked: {doomed.id}" in worker.output(), 30,
                   message=f"the revoke never arrived:\n{worker.output()[-3000:]}")
        assert long.get(timeout=60) == "long"
        wait_until(lambda: doomed.state == "REVOKED", 30,
                   message=f"state {doomed.state}; worker:\n{worker.output()[-3000:]}")
        assert executed_values(task_log) == {"long": 1}, worker.output()[-3000:]
    finally:
        client.close()


_PROCESS = r'''
import json, socket, sys
from celery import Celery, signals
from celery.concurrency import prefork
from kombu import Connection, Queue
import celery.worker.state as worker_state
from celery_zk.compat import celery_pool

url, other, as_worker = sys.argv[1], sys.argv[2], sys.argv[3] == "worker"
app = Celery("proc", broker=url, backend=url, set_as_current=True)
app.control.revoke("kept-task")        # kept in ZooKeeper for workers started later
if as_worker:
    signals.worker_init.send(sender=None)
with app.connection_for_read() as conn:
    with conn.Consumer(Queue("replies"), callbacks=[lambda body, message: None]):
        try:
            conn.drain_events(timeout=0.3)
        except socket.timeout:
            pass
        # A connection made and closed later in the worker (inspect report's is so)
        with Connection(other) as later:
            later.transport
        stamp = celery_pool._prefork_stamp
        print(json.dumps({
            "revoked": sorted(worker_state.revoked),
            "pool_patched": getattr(prefork.TaskPool.apply_async, "_celery_zk", False),
            "stamped_root": stamp(None)[2] if stamp else None,
        }))
'''


def _run_process(url: str, other: str, role: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _PROCESS, url, other, role],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_client_that_consumes_is_no_worker(zk_url: str, zk_client: KazooClient) -> None:
    """Flower or a web app calling ``inspect`` consumes too; it must not read
    every kept revoke into memory or patch pools it has not got. (Celery's
    Django fix-up imports ``celery.worker.state`` in every process with an
    app, which had counted as being a worker.)"""
    seen = _run_process(zk_url, zk_url, "client")
    assert seen == {"revoked": [], "pool_patched": False, "stamped_root": None}


def test_prefork_hand_overs_are_stamped_by_the_consuming_connection(
        zk_url: str, zk_chroot: str, zk_client: KazooClient) -> None:
    """A worker's consuming connection stamps what its prefork pool starts
    (which root's kept revokes a child reads, on which session); a connection
    the worker makes later, and closes, does not take that over."""
    seen = _run_process(zk_url, f"{zk_url}-other", "worker")
    assert seen == {"revoked": ["kept-task"], "pool_patched": True, "stamped_root": zk_chroot}
