"""``celery -A common.app worker`` processes: started, awaited, stopped, or run for one drain.

Every worker the scripts start is a real ``celery worker`` (``--without-mingle
--without-gossip --without-heartbeat``, loglevel WARNING) running
:mod:`common.app`, told its broker and its files by the environment; those of
a script that is its own app (``affinity.py``, ``limits.py``) at loglevel INFO
(:func:`start_workers`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .processes import BENCHMARKS, Processes, child_env, tail


def announce_ready(variable: str) -> None:
    """Once this process's worker consumes (``worker_ready``), write its pid to the
    file the environment ``variable`` names: at loglevel WARNING a worker prints no
    "ready." line to wait for."""
    from celery.signals import worker_ready

    def write(**_: Any) -> None:
        path = os.environ.get(variable)
        if path:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(str(os.getpid()))
    worker_ready.connect(write, weak=False)


def spawn_worker(procs: Processes, work_dir: str, name: str, broker: str, queue: str,
                 backend: str | None = None, env: dict[str, str] | None = None,
                 pool: str = "threads", concurrency: int = 4,
                 wait: bool = True) -> subprocess.Popen[bytes]:
    """Start ``celery -A common.app worker`` on ``queue`` (output in ``{name}.out``);
    with ``wait``, return once it consumes (common.app's ready file)."""
    ready = os.path.join(work_dir, f"{name}.ready")
    out = os.path.join(work_dir, f"{name}.out")
    args = [sys.executable, "-m", "celery", "-A", "common.app", "worker",
            f"--pool={pool}", "-c", str(concurrency), "--loglevel=WARNING",
            f"--hostname={name}@%h", "-Q", queue,
            "--without-mingle", "--without-gossip", "--without-heartbeat"]
    proc = procs.spawn(args, out, child_env({"BENCH_BROKER": broker,
                                             "BENCH_BACKEND": backend or "",
                                             "BENCH_READY_FILE": ready, **(env or {})}))
    if wait:
        try:
            await_ready(work_dir, [proc], [name])
        except RuntimeError:
            procs.stop_and_remove(proc)
            raise
    return proc


def await_ready(work_dir: str, workers: list[subprocess.Popen[bytes]], names: list[str]
                ) -> None:
    """Wait until each of ``workers`` (``spawn_worker(..., wait=False)``, named
    ``names``) consumes; RuntimeError with its output if one exits or is late."""
    deadline = time.monotonic() + 60 + 15 * len(workers)
    for proc, name in zip(workers, names):
        while not os.path.exists(os.path.join(work_dir, f"{name}.ready")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {name} did not become ready (exit "
                                   f"{proc.poll()}):\n"
                                   f"{tail(os.path.join(work_dir, name + '.out'))}")
            time.sleep(0.05)


def start_workers(app: str, names: list[str], pool: str, concurrency: int, work_dir: str,
                  env: dict[str, str]) -> Processes:
    """``celery -A {app} worker`` processes at loglevel INFO, one per name (its
    hostname; its output in ``{work_dir}/{name}.out``), returned once each has
    logged "ready."; SystemExit with a worker's output if it exits or is not ready
    within 90 s."""
    procs = Processes()
    for name in names:
        procs.spawn([sys.executable, "-m", "celery", "-A", app, "worker", f"--pool={pool}",
                     "-c", str(concurrency), "--loglevel=INFO", f"--hostname={name}@%h",
                     "--without-mingle", "--without-gossip", "--without-heartbeat"],
                    os.path.join(work_dir, f"{name}.out"), env, cwd=BENCHMARKS)
    deadline = time.monotonic() + 90
    for name, proc in zip(names, procs.procs):
        out = os.path.join(work_dir, f"{name}.out")
        while "ready." not in open(out, errors="replace").read():
            if proc.poll() is not None or time.monotonic() > deadline:
                procs.stop_together(grace=20)
                raise SystemExit(f"worker {name} did not start:\n"
                                 + open(out, errors="replace").read()[-3000:])
            time.sleep(0.05)
    return procs


class Workers:
    """The ``celery -A common.app worker`` processes of one run, named ``{prefix}{n}``,
    each running for one ``with`` block."""

    def __init__(self, procs: Processes, work_dir: str, prefix: str) -> None:
        self.procs, self.work_dir, self.prefix = procs, work_dir, prefix
        self.started = 0

    @contextmanager
    def worker(self, broker: str, queue: str, backend: str | None = None,
               env: dict[str, str] | None = None, wait: bool = True
               ) -> Iterator[subprocess.Popen[bytes]]:
        """A worker on ``queue``."""
        self.started += 1
        name = f"{self.prefix}{self.started}"
        proc = spawn_worker(self.procs, self.work_dir, name, broker, queue, backend=backend,
                            env=env, wait=wait)
        try:
            yield proc
            if proc.poll() is not None:
                out = os.path.join(self.work_dir, f"{name}.out")
                raise RuntimeError(f"worker exited early ({proc.returncode}):\n{tail(out)}")
        finally:
            self.procs.stop_and_remove(proc)

    def drain(self, broker: str, queue: str, total: int, timeout: float, label: str
              ) -> dict[str, Any]:
        """A worker started on ``queue`` runs ``total`` distinct ``bench.drain`` tasks
        (a backlog already there, or arriving); returns common.app's report (elapsed,
        distinct, executions)."""
        done = os.path.join(self.work_dir, f"{self.prefix}{self.started + 1}.drain.json")
        env = {"BENCH_DRAIN_TOTAL": str(total), "BENCH_DRAIN_FILE": done}
        with self.worker(broker, queue, env=env, wait=False) as proc:
            deadline = time.monotonic() + timeout
            while not os.path.exists(done):
                if proc.poll() is not None:
                    raise RuntimeError(f"{label}: drain worker exited ({proc.returncode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{label}: {total} tasks not drained in {timeout:.0f}s")
                time.sleep(0.5)   # drains of seconds to minutes (scale.py)
        with open(done, encoding="utf-8") as fh:
            return json.load(fh)
