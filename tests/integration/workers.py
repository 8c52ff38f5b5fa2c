"""Start and stop real ``celery worker`` processes for integration tests."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class Worker:
    """One ``celery -A proj.app worker`` subprocess with its output in a file."""

    def __init__(self, broker: str, *, backend: str | None = None, log: Path | None = None,
                 pool: str = "threads", concurrency: int = 4, name: str = "w1",
                 queues: str | None = None, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, tmp_dir: Path) -> None:
        self.name = name
        self.output_path = tmp_dir / f"worker-{name}.out"
        self.env = dict(os.environ)
        self.env.update({
            "CELERY_ZK_TEST_BROKER": broker,
            "CELERY_ZK_TEST_BACKEND": backend or "",
            "CELERY_ZK_TEST_LOG": str(log or ""),
            "PYTHONPATH": os.pathsep.join([str(HERE), self.env.get("PYTHONPATH", "")]),
        })
        self.env.update(env or {})
        self.args = [
            sys.executable, "-m", "celery", "-A", "proj.app", "worker",
            "--loglevel=INFO", f"--pool={pool}", f"--concurrency={concurrency}",
            f"--hostname={name}@%h", "--without-mingle", "--without-gossip",
        ]
        if queues:
            self.args.append(f"--queues={queues}")
        self.args += extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait_ready: bool = True, timeout: float = 60) -> Worker:
        self._out = open(self.output_path, "wb")
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        if wait_ready:
            self.wait_for("ready.", timeout)
        return self

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output():
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"worker {self.name} exited ({self.proc.returncode}):\n{self.output()}")
            time.sleep(0.05)
        raise AssertionError(f"worker {self.name} never printed {text!r}:\n{self.output()}")

    def diagnosis(self, tail: int = 30000) -> str:
        """The end of the worker's output after it logged every thread's stack
        (Celery's SIGUSR1 handler): for a failure that says it stalled."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGUSR1)
            time.sleep(1.0)
        return self.output()[-tail:]

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL the whole process group: the worker and its pool children."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        """Warm shutdown; SIGKILL if it does not exit in ``timeout``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        try:  # stray pool children
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._out.close()
        return self.proc.returncode

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    # A task may be mid-write while we read: the text after the last newline is
    # an unfinished line, parsed on a later read once it is whole.
    whole = path.read_text().rpartition("\n")[0]
    return [json.loads(line) for line in whole.split("\n") if line.strip()]


def executed_values(path: Path, kind: str | None = None) -> Counter[Any]:
    return Counter(json.dumps(e["value"]) if not isinstance(e["value"], (str, int)) else e["value"]
                   for e in read_log(path) if kind is None or e["kind"] == kind)


def wait_until(predicate: Any, timeout: float, interval: float = 0.1,
               message: str | Callable[[], str] = "") -> None:
    """Poll ``predicate`` until true; AssertionError after ``timeout`` s. A callable
    ``message`` is called then, so it can show the state that failed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError((message() if callable(message) else message)
                         or f"condition not met within {timeout}s")


def celery_cli(args: list[str], broker: str, timeout: float = 60,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``celery -A proj.app ARGS`` against ``broker``; returns the finished process."""
    full_env = dict(os.environ)
    full_env.update({
        "CELERY_ZK_TEST_BROKER": broker,
        "PYTHONPATH": os.pathsep.join([str(HERE), full_env.get("PYTHONPATH", "")]),
    })
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "celery", "-A", "proj.app", *args],
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def client_env(broker: str, backend: str | None = None) -> None:
    """Point this process's ``proj.app`` at the test broker before importing it."""
    os.environ["CELERY_ZK_TEST_BROKER"] = broker
    os.environ["CELERY_ZK_TEST_BACKEND"] = backend or ""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))


def run_example(name: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run ``examples/NAME.py`` as a user would; the finished process."""
    return subprocess.run([sys.executable, str(HERE.parents[1] / "examples" / f"{name}.py")],
                          capture_output=True, text=True, timeout=timeout)
