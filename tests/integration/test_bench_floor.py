"""benchmarks/floor.py against a real ZooKeeper: each mode completes its round trips."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kazoo.client import KazooClient

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("mode", ["claim", "get-delete", "result"])
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
