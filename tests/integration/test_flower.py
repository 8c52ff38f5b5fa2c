"""A real Flower 2.x against zk:// (broker and result backend) and a real worker."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from .workers import HERE, Worker, wait_until

SECRET = "fl0wer-Pa55"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture
def flower(tmp_path: Any) -> Iterator[Callable[[str], str]]:
    """Factory: start Flower for a broker URL; its base URL. Stopped by pid after."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(url: str) -> str:
        port = free_port()
        env = {**os.environ, "CELERY_ZK_TEST_BROKER": url, "CELERY_ZK_TEST_BACKEND": url,
               "FLOWER_UNAUTHENTICATED_API": "true",
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        out = open(tmp_path / "flower.out", "wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "proj.app", "flower",
             f"--port={port}", "--address=127.0.0.1"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert procs[-1].poll() is None, (tmp_path / "flower.out").read_text()
            try:
                return get(base + "/healthcheck")[0] == 200
            except OSError:
                return False

        wait_until(up, 60, 0.3, message="Flower did not start")
        return base

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_flower_shows_workers_and_tasks_and_no_password(
        zookeeper_server: Any, zk_chroot: str, start_worker: Callable[..., Worker],
        flower: Callable[[str], str]) -> None:
    url = f"zk://alice:{SECRET}@{zookeeper_server.hosts}{zk_chroot}/app"
    worker = start_worker(url, backend=url, name="flowerw", extra_args=["-E"])
    base = flower(url)
    client = Celery("client", broker=url, backend=url, set_as_current=False)
    try:
        def workers() -> dict[str, Any]:
            status, body = get(base + "/api/workers?refresh=1")
            return json.loads(body) if status == 200 else {}

        wait_until(lambda: any(name.startswith("flowerw@") for name in workers()), 60, 1,
                   message=f"Flower lists no worker: {workers()}")
        [name] = [n for n in workers() if n.startswith("flowerw@")]
        assert workers()[name]["stats"]["pool"]["max-concurrency"] == 4

        result = client.send_task("proj.app.add", args=(2, 3))
        assert result.get(timeout=30) == 5

        def task() -> dict[str, Any]:
            status, body = get(base + "/api/tasks")
            return json.loads(body).get(result.id, {}) if status == 200 else {}

        wait_until(lambda: task().get("state") == "SUCCESS", 60, 0.5,
                   message=f"Flower has not seen the task succeed: {task()}")
        assert task()["name"] == "proj.app.add" and task()["worker"] == name
        status, info = get(f"{base}/api/task/info/{result.id}")
        assert status == 200 and json.loads(info)["result"] == "5"

        # The pages operators open; none shows the password.
        for page in ("/", "/workers", "/tasks", f"/task/{result.id}", f"/worker/{name}"):
            status, body = get(base + page)
            assert status == 200, (page, status)
            assert SECRET not in body, page
        # Flower's Broker tab knows only amqp and redis URLs (docs/operations.md).
        status, body = get(base + "/broker")
        assert status == 404 and "broker is not supported" in body and SECRET not in body
    finally:
        client.close()
    assert worker.proc is not None and worker.proc.poll() is None
    # The worker and Flower are stopped by their fixtures, by pid.
