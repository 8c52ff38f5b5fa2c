"""What the tests of big messages and big results share."""
from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from celery_zk.pytest_plugin import kazoo_client


@pytest.fixture(autouse=True)
def wipe(zookeeper_server: Any, zk_chroot: str) -> Iterator[None]:
    """Big payloads are deleted after each test: the tests share one server, whose
    heap holds every byte. (Autouse in each module that imports it.)"""
    yield
    with kazoo_client(zookeeper_server.hosts) as root:
        root.delete(zk_chroot, recursive=True)


def text(size: int, seed: int = 0) -> str:
    """What proj.app.big_text returns: ``size`` characters that differ along the
    string and from seed to seed."""
    return random.Random(seed).randbytes(size // 2 + 1).hex()[:size]
