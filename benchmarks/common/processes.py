"""The processes of a run: each in a process group of its own, all stopped at the end.

Every script here starts its servers and workers through :class:`Processes`
and stops them by process group, also after an error or Ctrl-C.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .figures import log

#: The import root of the benchmarks (their children's PYTHONPATH starts here).
BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Processes:
    """Every subprocess the benchmark started, each in its own process group."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, args: list[str], out_path: str, env: dict[str, str] | None = None,
              cwd: str | None = None) -> subprocess.Popen[bytes]:
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(args, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    @staticmethod
    def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM,
             grace: float = 15.0) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:  # the group: pool threads' children, anything left behind
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()

    def stop_and_remove(self, proc: subprocess.Popen[bytes]) -> None:
        self.stop(proc)
        self.procs.remove(proc)

    def stop_all(self) -> None:
        """Newest first, each given its grace before the next is signalled."""
        while self.procs:
            self.stop(self.procs.pop())

    def stop_together(self, grace: float = 15.0) -> None:
        """SIGTERM to every group at once, then each waited for (peers, e.g. workers)."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        while self.procs:
            self.stop(self.procs.pop(0), sig=0, grace=grace)   # signal 0: none more


def tail(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return "".join(fh.readlines()[-30:])
    except OSError:
        return ""


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, benchmarks/ first on PYTHONPATH (a child imports
    ``common.app`` or ``affinity`` from there, and celery_zk from what follows), and
    ``extra``. ``PYTHONSAFEPATH`` (Python 3.11+): ``python -m celery`` would put
    its current directory first, and a run from a checkout (``/work/main``)
    measured that checkout's workers, not the one on PYTHONPATH."""
    env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONPATH=os.pathsep.join(
        filter(None, [BENCHMARKS, os.environ.get("PYTHONPATH")])))
    env.update(extra or {})
    return env


@contextmanager
def bench_run(prefix: str, keep: bool = False
              ) -> Iterator[tuple[Processes, str, list[Callable[[], None]]]]:
    """A run's processes, work directory and stack of things to stop: everything
    stopped at the end (also after an error, Ctrl-C or SIGTERM), the directory
    removed unless ``keep``."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))   # clean up as on Ctrl-C
    work_dir = tempfile.mkdtemp(prefix=prefix)
    procs = Processes()
    stack: list[Callable[[], None]] = []
    try:
        yield procs, work_dir, stack
    finally:
        procs.stop_all()
        for stop in reversed(stack):
            stop()
        if keep:
            log(f"work dir kept: {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
