from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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
