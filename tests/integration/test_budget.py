"""The storage budget (celery_zk.broker.budget) against real servers: a small
heap filled by several publisher processes, real workers draining it, the
clear error, the status, and the servers' own quota as the last line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kombu import Connection, Queue

from celery_zk.broker.budget import Use
from celery_zk.exceptions import StorageFull
from celery_zk.pytest_plugin import kazoo_client
from celery_zk.server import JVM_FLAGS, ZooKeeperServer
from celery_zk.transport import publish_together
from celery_zk.zk.layout import Layout

from .workers import HERE, celery_cli, executed_values, wait_until

#: 8 KB of payload: about 11 KB stored per message (kombu base64-encodes the body).
PAYLOAD = 8192
BUDGET_BYTES = 32 * 2**20


@pytest.fixture
def small_heap_server() -> Iterator[ZooKeeperServer]:
    """A server with a 256 MB heap, otherwise ZooKeeper's defaults."""
    flags = ("-Xms256m", "-Xmx256m", *(f for f in JVM_FLAGS if not f.startswith("-Xm")))
    with ZooKeeperServer(jvm_flags=flags) as server:
        yield server


def _publisher(url: str, count: int, prefix: str, out: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get(
        "PYTHONPATH", "")]))
    log = open(out.with_suffix(".err"), "wb")
    return subprocess.Popen([sys.executable, str(HERE / "fill_publisher.py"), url, str(count),
                             prefix, str(out), str(PAYLOAD)], env=env, stdout=log, stderr=log)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _blocked(client: KazooClient, layout: Layout) -> list[str]:
    return client.get_children(layout.blocked) if client.exists(layout.blocked) else []


@pytest.mark.slow
def test_publishers_block_at_the_budget_and_go_on_once_workers_drain_it(
        small_heap_server: ZooKeeperServer, start_worker, task_log: Path,
        tmp_path: Path) -> None:
    server = small_heap_server
    url = f"{server.url}/fill?budget_bytes={BUDGET_BYTES}"
    layout = Layout("/fill")
    # 3 publishers that wait, 1 that is refused after a second: 16,000 messages of
    # ~11 KB (~180 MB) offered, more than a 256 MB heap holds with ZooKeeper's
    # per-node overhead; the budget lets ~3,000 in.
    waiting = [_publisher(f"{url}&budget_wait=600", 4000, f"w{i}", tmp_path / f"w{i}.out")
               for i in range(3)]
    refused = _publisher(f"{url}&budget_wait=1", 4000, "r", tmp_path / "r.out")
    client = KazooClient(server.hosts)
    client.start()
    try:
        wait_until(lambda: len(_blocked(client, layout)) == 3 and refused.poll() is not None,
                   180, message=lambda: f"blocked: {_blocked(client, layout)}, refused "
                   f"publisher: {refused.poll()}, {_lines(tmp_path / 'r.out')[-1:]}")
        assert refused.returncode == 0
        last = _lines(tmp_path / "r.out")[-1]
        assert last.startswith("refused ") and "budget_bytes" in last and "/fill" in last
        assert all(p.poll() is None for p in waiting)   # held back, not failed
        use = Use.parse(client.get(layout.quota_stats)[0])
        assert use is not None and BUDGET_BYTES <= use.size < 2 * BUDGET_BYTES
        status = celery_cli(["zk", "status"], url)
        assert "FULL: 3 publisher process(es) blocked" in status.stdout, status.stdout
        assert server.ruok() and "OutOfMemoryError" not in server.read_log()

        start_worker(url, log=task_log, pool="threads", concurrency=4)
        start_worker(url, log=task_log, pool="prefork", concurrency=2)
        for publisher in waiting:
            assert publisher.wait(timeout=600) == 0
        returned = {line for name in ("w0", "w1", "w2", "r")
                    for line in _lines(tmp_path / f"{name}.out")
                    if not line.startswith("refused")}
        assert len(returned) == 3 * 4000 + len(_lines(tmp_path / "r.out")) - 1
        wait_until(lambda: set(executed_values(task_log)) >= returned, 300,
                   message=lambda: f"{len(returned - set(executed_values(task_log)))} "
                   "returned publishes not executed")
        executed = executed_values(task_log)
        assert set(executed) == returned   # a refused publish wrote nothing
        assert max(executed.values()) == 1
        assert not _blocked(client, layout)
        assert server.ruok() and "OutOfMemoryError" not in server.read_log()
    finally:
        for publisher in [*waiting, refused]:
            publisher.kill()
            publisher.wait()
        client.stop()
        client.close()


@pytest.mark.matrix
def test_full_budget_error_status_and_temporary_queues(zk_url: str, zk_chroot: str,
                                                       zookeeper_server: Any) -> None:
    url = f"{zk_url}?budget_nodes=40&budget_wait=0"
    with Connection(url) as conn:
        producer = conn.Producer()
        # Publishers read the use every CHECK_EVERY s: publish until that says full.
        deadline = time.monotonic() + 60
        with pytest.raises(StorageFull) as refused:
            while time.monotonic() < deadline:
                producer.publish({"i": 0}, routing_key="q", declare=[Queue("q")])
        message = str(refused.value)
        assert "budget_nodes" in message and "budget_wait" in message
        assert "nothing was written" in message and "celery zk status" in message
        # A temporary queue (replies, events) is let through; a new durable one is not.
        producer.publish({"reply": 1}, routing_key="tmp",
                         declare=[Queue("tmp", auto_delete=True)])
        assert conn.SimpleQueue(Queue("tmp", auto_delete=True)).get(timeout=10).payload == {
            "reply": 1}
        with pytest.raises(StorageFull):
            producer.publish({"i": -1}, routing_key="q2", declare=[Queue("q2")])
    layout = Layout(zk_chroot)
    with kazoo_client(zookeeper_server.hosts) as client:
        use = Use.parse(client.get(layout.quota_stats)[0])
    assert use is not None and use.nodes >= 40
    status = celery_cli(["zk", "status", "--json"], url)
    budget = json.loads(status.stdout)["budget"]
    assert budget["max_nodes"] == 40 and budget["nodes"] >= 40
    assert budget["blocked"] == []   # budget_wait=0: refused, never waiting
    text = celery_cli(["zk", "status"], url).stdout
    assert "storage budget:" in text and "no publisher blocked" in text


@pytest.mark.matrix
def test_an_enforced_quota_refuses_with_the_budgets_advice(tmp_path: Path) -> None:
    """Where the servers enforce quotas, a publish past the quota's hard limit
    fails with StorageFull naming it (here an operator's quota, below the budget)."""
    flags = ("-Dzookeeper.enforceQuota=true", *JVM_FLAGS)
    with ZooKeeperServer(jvm_flags=flags) as server:
        client = KazooClient(server.hosts)
        client.start()
        layout = Layout("/quota")
        client.ensure_path(layout.parent(layout.quota_limits))
        client.create(layout.quota_limits, b"count=-1,bytes=-1,countHardLimit=30")
        client.create(layout.quota_stats, b"count=0,bytes=0")
        try:
            with Connection(f"{server.url}/quota") as conn:
                producer = conn.Producer()
                with pytest.raises(StorageFull) as refused:   # the server refuses: at once
                    for index in range(100):
                        producer.publish({"i": index}, routing_key="q", declare=[Queue("q")])
                assert "zookeeper.enforceQuota" in str(refused.value)
                assert "quota" in str(refused.value) and "/quota" in str(refused.value)
                # A group's batch (publish_together) is refused the same way.
                with pytest.raises(StorageFull, match="zookeeper.enforceQuota"):
                    with publish_together():
                        for index in range(10):
                            producer.publish({"g": index}, routing_key="q")
            # The operator's limits stay as they were.
            assert client.get(layout.quota_limits)[0].endswith(b"countHardLimit=30")
        finally:
            client.stop()
            client.close()
