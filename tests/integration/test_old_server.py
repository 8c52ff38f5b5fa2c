"""A ZooKeeper older than 3.6, which has no persistent watches (``addWatch``).

Such a server answers ``addWatch`` with Unimplemented and closes the
connection (ZooKeeper's UnimplementedRequestProcessor, the same in 3.4 and
3.5). celery_zk then turns persistent watches off for the process, says so
once, and waits on one-shot child watches. Tested on a real ZooKeeper 3.4.13,
Debian's previous release (:mod:`.old_zookeeper`).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery, chord, group

from celery_zk.server import ZooKeeperServer

from .old_zookeeper import zookeeper_3_4
from .workers import Worker, celery_cli

pytestmark = pytest.mark.matrix

FALLBACK = "persistent watches are off: the ZooKeeper server is older than 3.6"


@pytest.fixture(scope="module")
def old_server() -> Iterator[ZooKeeperServer]:
    with ZooKeeperServer(install=zookeeper_3_4()) as server:
        yield server


def test_a_worker_and_a_client_on_zookeeper_3_4(
        old_server: ZooKeeperServer, start_worker: Callable[..., Worker]) -> None:
    url = f"{old_server.url}/old-{uuid.uuid4().hex[:8]}"
    worker = start_worker(url, backend=url, pool="prefork", concurrency=2)
    app = Celery("old", broker=url, backend=url, set_as_current=False)

    def sig(name: str, *args: Any) -> Any:
        return app.signature(f"proj.app.{name}", args)

    try:
        try:
            first = app.send_task("proj.app.add", (2, 3)).get(timeout=60)
        except Exception as exc:
            raise AssertionError(f"{exc!r}; the worker said:\n{worker.output()[-20000:]}") from exc
        assert first == 5
        assert group(sig("add", i, i) for i in range(10)).apply_async().get(
            timeout=60) == [2 * i for i in range(10)]
        assert chord([sig("add", i, i) for i in range(10)])(sig("tsum")).get(timeout=60) == 90
        # Idle now: a new message still wakes the worker (one-shot watches).
        for i in range(5):
            assert app.send_task("proj.app.add", (i, 1)).get(timeout=30) == i + 1
    finally:
        app.close()
    output = worker.output()
    assert output.count(FALLBACK) == 1, output[-3000:]
    # The question was never put to the worker's session: it was never dropped.
    assert "Connection to broker lost" not in output, output[-3000:]
    status = celery_cli(["zk", "status", "--json"], url)
    assert status.returncode == 0, status.stderr
    [server] = json.loads(status.stdout)["servers"].values()
    assert server["zk_version"].startswith("3.4."), server
