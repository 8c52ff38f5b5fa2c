"""benchmarks/floor.py against a real ZooKeeper: each mode completes its round trips."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kazoo.client import KazooClient

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize(
    "mode", ["claim", "claim-listing", "get-delete", "result", "handoff", "split"])
def test_floor_round_trips_complete_and_clean_up(zk_client: KazooClient, zk_hosts: str,
                                                 mode: str) -> None:
    sys.path.insert(0, str(BENCHMARKS))  # the spawned side imports floor too
    try:
        from floor import measure
        values = measure(zk_hosts, mode, samples=3)
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert len(values) == 3
    assert min(values) > 0
    assert zk_client.get_children("/") == []  # its nodes are gone


def test_request_cost_raw_client_talks_zookeeper(zookeeper_server: object,
                                                 zk_client: KazooClient,
                                                 zk_chroot: str) -> None:
    """request_cost.py's socket-level client really creates and looks up nodes."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from kazoo.protocol.serialization import Create, Exists
        from kazoo.security import OPEN_ACL_UNSAFE
        from request_cost import SEQUENTIAL, RawClient, timed
    finally:
        sys.path.remove(str(BENCHMARKS))
    raw = RawClient(zookeeper_server.hosts)  # type: ignore[attr-defined]
    try:
        for _ in range(3):
            raw.call(Create(f"{zk_chroot}/m-", b"data", OPEN_ACL_UNSAFE, SEQUENTIAL))
        assert timed(lambda: raw.call(Exists(zk_chroot, False)), 2, idle=False) > 0
    finally:
        raw.close()
    names = sorted(zk_client.get_children("/"))
    assert [n[:2] for n in names] == ["m-"] * 3
    assert zk_client.get(f"/{names[0]}")[0] == b"data"
