"""The Celery app ``./dev demo`` runs: ZooKeeper as broker *and* result backend.

The worker is started with ``celery -A demo_app worker`` from this directory;
``CELERY_ZK_DEMO_URL`` (set by ``demo.py``) points both at the same ZooKeeper
chroot.
"""
from __future__ import annotations

import os

from celery import Celery

URL = os.environ.get("CELERY_ZK_DEMO_URL", "zk://127.0.0.1:2181/celery-zk-demo")

app = Celery("demo_app", broker=URL, backend=URL)
app.conf.update(
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task
def mul(x: int, y: int) -> int:
    return x * y


@app.task
def tsum(numbers: list[int]) -> int:
    return sum(numbers)
