"""A ZooKeeper older than 3.6, which has no persistent watches (``addWatch``):
refused at once, with an error naming the version found and the one needed.

Such a server answers ``addWatch`` with Unimplemented and closes the
connection (ZooKeeper's UnimplementedRequestProcessor, the same in 3.4 and
3.5): celery_zk asks on a client of its own before it makes a session.
Tested on a real ZooKeeper 3.4.13, Debian's previous release
(:mod:`.old_zookeeper`).
"""
from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_zk.exceptions import ZKServerTooOld
from celery_zk.server import ZooKeeperServer

from .old_zookeeper import zookeeper_3_4
from .workers import celery_cli

pytestmark = pytest.mark.matrix


@pytest.fixture(scope="module")
def old_server() -> Iterator[ZooKeeperServer]:
    with ZooKeeperServer(install=zookeeper_3_4()) as server:
        yield server


def test_a_client_and_a_worker_on_zookeeper_3_4_are_told_what_is_needed(
        old_server: ZooKeeperServer) -> None:
    url = f"{old_server.url}/old-{uuid.uuid4().hex[:8]}"
    app = Celery("old", broker=url, backend=url, set_as_current=False)
    try:
        with pytest.raises(ZKServerTooOld, match=r"is ZooKeeper 3\.4\.13; celery_zk needs "
                                                 r"ZooKeeper 3\.6 or newer"):
            app.send_task("proj.app.add", (2, 3))
    finally:
        app.close()
    worker = celery_cli(["worker", "-P", "solo", "--without-mingle", "--without-gossip"],
                        url, timeout=120)
    assert worker.returncode != 0, worker.stdout[-3000:]
    assert "ZooKeeper 3.4.13; celery_zk needs ZooKeeper 3.6 or newer" in worker.stderr, (
        worker.stderr[-3000:])
