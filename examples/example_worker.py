"""Starting and stopping the worker subprocess of an example (shared by them)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def start_worker(module: str, env: dict[str, str], log_path: Path, pool: str = "threads",
                 wait_ready: bool = True, name: str | None = None,
                 concurrency: int = 2) -> subprocess.Popen[bytes]:
    """``celery -A MODULE worker`` of this folder, its output in ``log_path``."""
    full_env = {**os.environ, **env,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE),
                                                            os.environ.get("PYTHONPATH")]))}
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", module, "worker", "--loglevel=INFO",
             f"--pool={pool}", f"--concurrency={concurrency}",
             f"--hostname={name or module}@%h", "--without-mingle", "--without-gossip"],
            cwd=HERE, env=full_env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)  # own group: we stop it and its children together
    deadline = time.monotonic() + 60
    while wait_ready and "ready." not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_worker(proc)
            raise SystemExit(f"worker did not start:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.1)
    return proc


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    """Warm shutdown, then the whole process group is killed whatever is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class Example:
    """A throwaway ZooKeeper, a client app on it, and the example's worker once
    started; all stopped on exit, whatever happens (SIGTERM included)."""

    def __init__(self, module: str, url_env: str, path: str, credentials: str = "") -> None:
        self.module, self.url_env = module, url_env
        self.path, self.credentials = path, credentials
        self.worker: subprocess.Popen[bytes] | None = None   # the last one started
        self.workers: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Example:
        from celery import Celery

        from celery_zk.server import ZooKeeperServer

        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        self._stack = contextlib.ExitStack()
        zk = self._stack.enter_context(ZooKeeperServer())
        self.log_path = Path(self._stack.enter_context(tempfile.TemporaryDirectory())) / "w.log"
        self.url = f"zk://{self.credentials}{zk.hosts}/{self.path}"
        self.client = Celery("client", broker=self.url, backend=self.url,
                             set_as_current=False)
        return self

    def start_worker(self, pool: str = "threads", name: str | None = None,
                     concurrency: int = 2, env: dict[str, str] | None = None
                     ) -> subprocess.Popen[bytes]:
        """Start a worker of the example's module (``name``: a second one's)."""
        log_path = self.log_path if name is None else self.log_path.with_name(f"{name}.log")
        self.worker = start_worker(self.module, {self.url_env: self.url, **(env or {})},
                                   log_path, pool, name=name, concurrency=concurrency)
        self.workers.append(self.worker)
        return self.worker

    def worker_output(self, name: str | None = None) -> str:
        log_path = self.log_path if name is None else self.log_path.with_name(f"{name}.log")
        return log_path.read_text(errors="replace")

    def __exit__(self, *exc: object) -> None:
        import kombu.pools

        try:
            self.client.backend.close()
            self.client.close()
            kombu.pools.reset()  # app.close() leaves pooled producers connected
            for worker in self.workers:
                stop_worker(worker)
        finally:
            self._stack.close()
