from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .workers import Worker


@pytest.fixture
def task_log(tmp_path: Path) -> Path:
    """File every executed test task appends a line to."""
    return tmp_path / "executed.jsonl"


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator:
    """Factory: start_worker(broker, ...) -> started Worker, stopped after the test."""
    workers: list[Worker] = []

    def start(broker: str, **kwargs) -> Worker:
        kwargs.setdefault("name", f"w{len(workers) + 1}")
        worker = Worker(broker, tmp_dir=tmp_path, **kwargs)
        workers.append(worker)
        return worker.start()

    yield start
    for worker in workers:
        worker.stop()


@pytest.fixture
def worker(start_worker: Callable[..., Worker], zk_url: str) -> Callable[..., Worker]:
    """Factory: a real worker with ``zk_url`` as broker and result backend;
    ``conf=`` goes to its app's config (CELERY_ZK_TEST_CONF)."""
    def start(**kwargs: Any) -> Worker:
        env = kwargs.pop("env", {})
        conf = kwargs.pop("conf", {})
        if conf:
            env["CELERY_ZK_TEST_CONF"] = json.dumps(conf)
        return start_worker(zk_url, backend=zk_url, env=env, **kwargs)
    return start
