"""ZooKeeper sessions per process, as the server counts them (issue 13's figures).

Starts its own ZooKeeper with ZooKeeper's default settings (60 connections
per client IP) and measures:

* sessions of a process that made 5 kombu Connections and dropped them
  without ``close()`` (while held, and after garbage collection);
* sessions of a prefork worker ``-c 4`` and of a client that ran 1,000 tasks
  with results and dropped 50 Connections;
* seconds until ``Connection('zk://127.0.0.1:1/x', connect_timeout=3).connect()``
  fails (kombu's connect() tries twice, 2 s apart), and the same against a
  port that accepts connections and never answers;
* ``celery inspect stats`` output: whether a password shows.

Usage: ``.venv/bin/python benchmarks/sessions.py``
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kombu import Connection

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import log  # noqa: E402

from celery_zk.server import ZooKeeperServer  # noqa: E402
from tests.integration.sessions import count, process_tree, sessions_by_pid  # noqa: E402
from tests.integration.test_sessions import CLIENT, DROPPED  # noqa: E402

PROJ = ROOT / "tests" / "integration"
SECRET = "s3cr3t-Pw9"


def scripted(source: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", source], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(PROJ), **env))


def step(proc: subprocess.Popen[str], expect: str) -> None:
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline().strip()
    assert line == expect, line


def go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def settle(address: tuple[str, int], pid: int, want: int, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while True:
        now = sessions_by_pid(*address)[pid]
        if now <= want or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def connect_time(url: str, timeout: float) -> str:
    started = time.monotonic()
    try:
        Connection(url, connect_timeout=timeout).connect()
        outcome = "connected?!"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {str(exc)[:90]}"
    return f"{time.monotonic() - started:.2f} s ({outcome})"


def main() -> int:
    with ZooKeeperServer() as zk, tempfile.TemporaryDirectory() as tmp:
        address = (zk.host, zk.client_port)
        url = f"{zk.url}/sessions-bench"
        results: dict[str, object] = {}

        proc = scripted(DROPPED.format(url=url, n=5), {})
        step(proc, "holding")
        results["5 Connections held: sessions"] = sessions_by_pid(*address)[proc.pid]
        go(proc)
        step(proc, "dropped")
        results["5 Connections dropped, after gc: sessions"] = settle(address, proc.pid, 0)
        go(proc)
        proc.wait(30)

        env = {"CELERY_ZK_TEST_BROKER": url, "CELERY_ZK_TEST_BACKEND": url}
        out = open(Path(tmp) / "worker.out", "wb")
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "proj.app", "worker", "-P", "prefork",
             "-c", "4", "--loglevel=WARNING", "--without-mingle", "--without-gossip"],
            env=dict(os.environ, PYTHONPATH=str(PROJ), **env), stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            client = scripted(CLIENT.format(url=url, tasks=1000, dropped=50), env)
            step(client, "done")
            sessions = sessions_by_pid(*address)
            results["client after 1,000 tasks with results + 50 dropped Connections"] = (
                sessions[client.pid])
            results["prefork worker -c 4 (5 processes)"] = count(sessions,
                                                                 process_tree(worker.pid))
            results["all sessions on the server"] = sum(sessions.values())
            go(client)
            client.wait(30)

            stats = subprocess.run(
                [sys.executable, "-m", "celery", "-A", "proj.app", "inspect", "stats",
                 "--json", "--timeout=5"], capture_output=True, text=True,
                env=dict(os.environ, PYTHONPATH=str(PROJ), **env), timeout=60)
            broker = next(iter(json.loads(stats.stdout).values()))["broker"]
            results["inspect stats 'broker'"] = broker
        finally:
            os.killpg(worker.pid, 9)
            worker.wait()
            out.close()

    secret_url = f"zk://alice:{SECRET}@127.0.0.1:{zk.client_port}/x?read_only_users=bob:{SECRET}"
    with ZooKeeperServer() as zk2:
        secret_url = secret_url.replace(f":{zk.client_port}/", f":{zk2.client_port}/")
        env = {"CELERY_ZK_TEST_BROKER": secret_url, "CELERY_ZK_TEST_BACKEND": secret_url}
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "proj.app", "worker", "-P", "threads",
             "--loglevel=WARNING", "--without-mingle", "--without-gossip"],
            env=dict(os.environ, PYTHONPATH=str(PROJ), **env), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            time.sleep(5)
            stats = subprocess.run(
                [sys.executable, "-m", "celery", "-A", "proj.app", "inspect", "stats",
                 "--json", "--timeout=5"], capture_output=True, text=True,
                env=dict(os.environ, PYTHONPATH=str(PROJ), **env), timeout=60)
            results["inspect stats with a password: 'broker'"] = next(
                iter(json.loads(stats.stdout).values()))["broker"]
            results["password anywhere in inspect stats"] = SECRET in stats.stdout
        finally:
            os.killpg(worker.pid, 9)
            worker.wait()

    results["connect_timeout=3, nothing listening (port 1)"] = connect_time(
        "zk://127.0.0.1:1/x", 3)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        results["connect_timeout=3, a port that never answers"] = connect_time(
            f"zk://127.0.0.1:{port}/x", 3)
    for name, value in results.items():
        log(f"{name}: {value}", "sessions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
