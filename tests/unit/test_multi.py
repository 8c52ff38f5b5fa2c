"""celery_zk.zk.multi: the one-pass serializer writes what kazoo's would, byte
for byte, for every operation the hot multis use and any ACL."""
from __future__ import annotations

from kazoo.client import KazooClient
from kazoo.protocol.serialization import CheckVersion, Create, Delete, SetData, Transaction
from kazoo.security import OPEN_ACL_UNSAFE, make_digest_acl

from celery_zk.zk.multi import Multi, _Request


def ops(acl: list) -> list:
    return [CheckVersion("/root/q/consumers/c-0000000001", -1),
            Delete("/root/q/unowned/b/n-0001", 3),
            Create("/root/q/owned/c1/n-0001", b"", acl, 0),
            Create("/root/q/owned/c1/n-0002", "é body".encode(), acl, 0),
            SetData("/root/limits/given/rate", b'{"t": [1.5]}', -1),
            Delete("/root/q/bodies/b/\u00e9", -1)]


def test_the_request_is_kazoos_byte_for_byte() -> None:
    digest = [make_digest_acl("user", "secret", all=True)] + list(OPEN_ACL_UNSAFE)
    for acl in (OPEN_ACL_UNSAFE, digest):
        assert _Request(ops(acl)).serialize() == bytes(Transaction(ops(acl)).serialize())
    assert _Request([]).serialize() == bytes(Transaction([]).serialize())
    assert _Request(ops(OPEN_ACL_UNSAFE)).type == Transaction.type


def test_paths_go_under_the_chroot_and_creates_take_the_default_acl() -> None:
    digest = [make_digest_acl("user", "secret", all=True)]
    client = KazooClient(hosts="127.0.0.1:1/chrooted/", default_acl=digest)
    multi = Multi(client)
    multi.check("/q/consumers/c", -1)
    multi.create("/q/owned/c/n", b"x")
    multi.delete("/q/unowned/b/n", version=2)
    multi.set_data("/q/meta", b"{}")
    assert multi.operations == [CheckVersion("/chrooted/q/consumers/c", -1),
                                Create("/chrooted/q/owned/c/n", b"x", digest, 0),
                                Delete("/chrooted/q/unowned/b/n", 2),
                                SetData("/chrooted/q/meta", b"{}", -1)]
    plain = Multi(KazooClient(hosts="127.0.0.1:1"))
    plain.create("/q/n")
    assert plain.operations == [Create("/q/n", b"", OPEN_ACL_UNSAFE, 0)]
