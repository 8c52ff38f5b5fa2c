"""Results expire without beat: real workers delete them, one process a round
(celery_zk.backend.autoexpire), against a real ZooKeeper."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery, states
from celery.beat import Scheduler
from kazoo.client import KazooClient

from celery_zk.backend import ZooKeeperBackend
from celery_zk.backend.autoexpire import cleaner as make_cleaner
from celery_zk.backend.expiry import HOUR
from celery_zk.ops.exporter import StatusCollector
from celery_zk.ops.report import format_status
from celery_zk.ops.status import collect
from celery_zk.zk.config import parse_url
from celery_zk.zk.rounds import stamped_at

from .workers import Worker, wait_until

EXPIRES = 2   # seconds: a result written 3 h ago (its index hour) and 2 s ago (its node) is old


@pytest.fixture
def app(zk_url: str) -> Iterator[Celery]:
    client_app = Celery("expire", broker="memory://", backend=zk_url, set_as_current=False)
    client_app.conf.result_expires = EXPIRES
    yield client_app
    client_app.backend.close()
    client_app.close()


def _store_old_and_fresh(backend: ZooKeeperBackend) -> tuple[list[str], str]:
    """Results indexed 3 h ago, and one of this hour; then waits until the old
    ones' nodes are older than ``EXPIRES`` (cleanup() checks the node's mtime too)."""
    now = time.time()
    backend.clock = lambda: now - 3 * HOUR
    old = [f"old-{i}" for i in range(5)]
    for task_id in old:
        backend.store_result(task_id, task_id, states.SUCCESS)
    backend.clock = time.time
    backend.store_result("fresh", "fresh", states.SUCCESS)
    time.sleep(EXPIRES + 0.5)
    return old, "fresh"


def _stored(backend: ZooKeeperBackend, task_id: str) -> bool:
    return backend.client.exists(backend.layout.result(task_id)) is not None


def _report(backend: ZooKeeperBackend) -> tuple[str, dict[str, float]]:
    """What `celery zk status` prints, and what the exporter serves."""
    status = collect(backend.client, backend.layout, backend.settings.hosts,
                     results_layout=backend.layout, queues=[], health=False)
    metrics = {sample.name: sample.value for family in StatusCollector(lambda: status).collect()
               for sample in family.samples}
    return format_status(status, "zk://x"), metrics


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_worker_deletes_expired_results_with_no_beat(
        app: Celery, zk_url: str, tmp_path: Path, pool: str) -> None:
    backend = app.backend
    old, fresh = _store_old_and_fresh(backend)
    conf = {"result_expires": EXPIRES,
            "result_backend_transport_options": {"expire_every": 0.5}}
    with Worker(zk_url, backend=zk_url, pool=pool, concurrency=2, tmp_dir=tmp_path,
                env={"CELERY_ZK_TEST_CONF": json.dumps(conf)}) as worker:
        # The round logs once it has stamped, after its deletes: wait for both.
        wait_until(lambda: "expired results cleaned" in worker.output(), timeout=30,
                   message=lambda: worker.output()[-3000:])
        assert not any(_stored(backend, t) for t in old)
    assert _stored(backend, fresh)   # this hour's result waits for its hour to pass
    last = stamped_at(backend.client.exists(backend.layout.expiry))
    assert last is not None and last > time.time() - 60
    assert backend.client.exists(backend.layout.expiry_cleaner) is None


def test_one_process_cleans_at_a_time_and_a_dead_cleaners_round_goes_on(
        app: Celery, zk_url: str) -> None:
    """The lock held by another session: no round here. That session gone (a
    cleaner killed mid-round, its stamp never written): the next look runs it."""
    backend = app.backend
    old, _ = _store_old_and_fresh(backend)
    cleaner = make_cleaner(backend, every=600)
    assert "expired ones never deleted yet" in _report(backend)[0]
    settings = parse_url(zk_url)
    other = KazooClient(hosts=settings.hosts)
    other.start()
    try:
        other.create(backend.layout.expiry_cleaner, ephemeral=True)
        assert not cleaner.run_if_due()
        assert all(_stored(backend, t) for t in old)
    finally:
        other.stop()
        other.close()
    assert cleaner.run_if_due()
    assert not any(_stored(backend, t) for t in old)
    report, metrics = _report(backend)
    assert "expired ones last deleted 0s ago" in report
    assert abs(metrics["celery_zk_results_cleaned_timestamp_seconds"] - time.time()) < 60
    assert not cleaner.run_if_due()   # stamped: the next round is expire_every away
    backend.clock = lambda: time.time() + 601
    assert cleaner.run_if_due()


def test_no_cleaner_with_expire_every_0_or_no_result_expires(app: Celery, zk_url: str) -> None:
    from celery_zk.backend import autoexpire

    class Consumer:   # what worker_ready sends: something with .app
        def __init__(self, app: Celery) -> None:
            self.app = app

    for options, expires in (({"expire_every": 0}, EXPIRES), ({}, None)):
        quiet = Celery("quiet", broker="memory://", backend=zk_url, set_as_current=False)
        quiet.conf.result_backend_transport_options = options
        quiet.conf.result_expires = expires
        try:
            autoexpire._on_worker_ready(sender=Consumer(quiet))
            assert id(quiet) not in autoexpire._running
        finally:
            quiet.close()
    autoexpire._on_worker_ready(sender=Consumer(app))
    try:
        assert autoexpire._running[id(app)].every == 600
    finally:
        autoexpire._on_worker_shutdown()
    assert not autoexpire._running


def test_beat_schedules_no_backend_cleanup(app: Celery) -> None:
    """supports_autoexpire: beat adds no celery.backend_cleanup of its own."""
    scheduler = Scheduler(app, lazy=True)
    scheduler.install_default_entries(scheduler.data)
    assert "celery.backend_cleanup" not in scheduler.schedule
