"""``./dev demo``: a throwaway ZooKeeper, a real worker, and a few canvases.

Starts ZooKeeper on a free port with a temporary data dir, starts
``celery -A demo_app worker`` against it (broker and result backend both
``zk://``), sends a task, a chain, a group and a chord, and checks every
result. Exit status 0 means every result was right.

Whatever happens (a wrong result, an error, Ctrl-C, SIGTERM), the worker and
ZooKeeper are stopped before we exit: the worker runs in its own process
group, and ``ZooKeeperServer``'s ``with`` block stops Java.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import kombu.pools
from celery import chain, chord, group

from celery_zk.server import ZooKeeperServer

HERE = Path(__file__).resolve().parent
CHROOT = "/celery-zk-demo"
TIMEOUT = 60.0


def _sigterm(signum: int, frame: FrameType | None) -> None:
    # Default SIGTERM would skip the finally blocks and leave processes behind.
    raise SystemExit(128 + signum)


class DemoWorker:
    """``celery -A demo_app worker`` as a subprocess, output kept in a file."""

    def __init__(self, url: str, log_path: Path) -> None:
        self.log_path = log_path
        self.env = {**os.environ, "CELERY_ZK_DEMO_URL": url,
                    "PYTHONPATH": os.pathsep.join(filter(None, [
                        str(HERE), os.environ.get("PYTHONPATH")]))}
        self.args = [sys.executable, "-m", "celery", "-A", "demo_app", "worker",
                     "--loglevel=INFO", "--concurrency=2", "--hostname=demo@%h",
                     "--without-mingle", "--without-gossip"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as out:
            # Own session: Ctrl-C reaches only us, and we stop the worker in order.
            self.proc = subprocess.Popen(self.args, cwd=HERE, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + TIMEOUT
        while "ready." not in self.output():
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker was not ready after {TIMEOUT:.0f}s")
            time.sleep(0.1)

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the worker exited with status {self.proc.returncode}")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """Warm shutdown (SIGTERM), SIGKILL after 30 s, then any stray pool children."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                print("demo: the worker ignored SIGTERM for 30s; killing it", file=sys.stderr)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def run_checks(worker: DemoWorker) -> bool:
    from demo_app import add, app, mul, tsum

    def wait(result: Any) -> Any:
        # Poll in short slices so a crashed worker fails fast instead of timing out.
        deadline = time.monotonic() + TIMEOUT
        while True:
            worker.check_alive()
            try:
                return result.get(timeout=1.0)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    checks: list[tuple[str, Callable[[], Any], Any]] = [
        ("add(2, 3)", lambda: add.delay(2, 3), 5),
        ("chain: add(2, 2) | mul(8)", lambda: chain(add.s(2, 2), mul.s(8)).delay(), 32),
        ("group: add(i, i) for i in 0..9",
         lambda: group(add.s(i, i) for i in range(10)).delay(), [i + i for i in range(10)]),
        ("chord: tsum(add(i, i) for i in 0..9)",
         lambda: chord(add.s(i, i) for i in range(10))(tsum.s()), 90),
    ]
    print(f"demo: broker   {app.conf.broker_url}")
    print(f"demo: backend  {app.conf.result_backend}")
    ok = True
    try:
        for label, send, expected in checks:
            started = time.monotonic()
            got = wait(send())
            elapsed = time.monotonic() - started
            good = got == expected
            ok = ok and good
            verdict = "ok" if good else f"WRONG, expected {expected!r}"
            print(f"  {label:<38} = {got!r:<10} {verdict}  ({elapsed:.2f}s)")
    finally:
        # End our ZooKeeper sessions before the server goes away, not after:
        # app.close() leaves the producers in kombu's global pools connected.
        app.backend.close()
        app.close()
        kombu.pools.reset()
    return ok


def main() -> int:
    signal.signal(signal.SIGTERM, _sigterm)
    sys.path.insert(0, str(HERE))
    with tempfile.TemporaryDirectory(prefix="celery-zk-demo-") as tmp:
        worker_log = Path(tmp) / "worker.log"
        ok = False
        print("demo: starting ZooKeeper on a free port (temporary data dir)")
        with ZooKeeperServer() as zk:
            url = zk.url + CHROOT
            os.environ["CELERY_ZK_DEMO_URL"] = url  # read by demo_app on import
            print(f"demo: ZooKeeper is ready at {zk.url}; starting the worker")
            worker = DemoWorker(url, worker_log)
            try:
                worker.start()
                print("demo: worker ready; sending tasks")
                ok = run_checks(worker)
            except (KeyboardInterrupt, SystemExit):
                print("demo: interrupted; stopping the worker and ZooKeeper", file=sys.stderr)
                raise
            except Exception as exc:
                print(f"demo: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
            finally:
                worker.stop()
            if not ok:
                tail = "\n".join(worker.output().splitlines()[-40:])
                print(f"demo: last lines of the worker log:\n{tail}", file=sys.stderr)
        print("demo: worker and ZooKeeper stopped")
    print("demo: all results correct" if ok else "demo: FAILED (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # everything is stopped by now
        sys.exit(130)
