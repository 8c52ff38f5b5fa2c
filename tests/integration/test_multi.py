"""celery_zk.zk.multi on a real ZooKeeper: a Multi commits and is refused as
kazoo's own transaction is, under a chroot too."""
from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError, RolledBackError
from kazoo.protocol.states import ZnodeStat

from celery_zk.zk.client import make_client
from celery_zk.zk.config import parse_url
from celery_zk.zk.multi import Multi

#: kazoo's _call sends it: every supported kazoo release runs this.
pytestmark = pytest.mark.matrix


@pytest.fixture
def client(zk_url: str) -> Iterator[KazooClient]:
    client = make_client(parse_url(zk_url))
    try:
        yield client
    finally:
        client.stop()
        client.close()


def test_a_multi_commits_and_is_refused_as_kazoos_transaction(client: KazooClient) -> None:
    root = f"/multi-{uuid.uuid4().hex[:8]}"
    client.ensure_path(f"{root}/unowned")
    client.create(f"{root}/unowned/a")
    client.create(f"{root}/consumer")
    multi = Multi(client)
    multi.check(f"{root}/consumer", -1)
    multi.delete(f"{root}/unowned/a")
    multi.create(f"{root}/owned-a", "body é".encode())
    multi.set_data(f"{root}/consumer", b"credit")
    results = multi.commit()
    assert results[:3] == [True, True, f"{root}/owned-a"]
    assert isinstance(results[3], ZnodeStat) and results[3].version == 1
    assert client.get(f"{root}/owned-a")[0] == "body é".encode()
    assert client.exists(f"{root}/unowned/a") is None
    assert client.get(f"{root}/consumer")[0] == b"credit"
    # Refused by its second operation: nothing of it is applied, as with kazoo's.
    refused = Multi(client)
    refused.create(f"{root}/owned-b")
    refused.delete(f"{root}/unowned/a")   # gone already
    ours = refused.commit()
    txn = client.transaction()
    txn.create(f"{root}/owned-b")
    txn.delete(f"{root}/unowned/a")
    theirs = txn.commit()
    assert [type(r) for r in ours] == [type(r) for r in theirs] == [RolledBackError,
                                                                      NoNodeError]
    assert client.exists(f"{root}/owned-b") is None


def test_paths_under_a_chroot_come_back_without_it(zk_url: str, client: KazooClient) -> None:
    root = f"/multi-chroot-{uuid.uuid4().hex[:8]}"
    client.ensure_path(f"{root}/inner")
    hosts = zk_url.split("://", 1)[1].split("/", 1)[0]
    chrooted = KazooClient(hosts=f"{hosts}{root}")
    chrooted.start()
    try:
        multi = Multi(chrooted)
        multi.create("/inner/n", b"x")
        assert multi.commit() == ["/inner/n"]
        assert client.get(f"{root}/inner/n")[0] == b"x"
    finally:
        chrooted.stop()
        chrooted.close()
