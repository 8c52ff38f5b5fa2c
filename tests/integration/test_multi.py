"""celery_zk.zk.multi on a real ZooKeeper: a Multi commits and is refused as
kazoo's own transaction is, on a chrooted client (paths go under the chroot
and come back without it)."""
from __future__ import annotations

import uuid

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError, RolledBackError
from kazoo.protocol.states import ZnodeStat

from celery_zk.zk.multi import Multi

#: kazoo's _call sends it: every supported kazoo release runs this.
pytestmark = pytest.mark.matrix


def test_a_multi_commits_and_is_refused_as_kazoos_transaction(zk_client: KazooClient) -> None:
    client = zk_client
    assert client.chroot   # the plugin's client is chrooted: Multi must add it
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
    assert results[:3] == [True, True, f"{root}/owned-a"]   # without the chroot
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
