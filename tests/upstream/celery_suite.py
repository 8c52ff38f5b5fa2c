"""Run Celery's own integration suites against celery_zk (or Redis, for comparison).

Fetches the sdist of the *installed* Celery (once, into ``.cache/``), starts a
ZooKeeper with its default settings (celery_zk's launcher; nothing about
connections in zoo.cfg, so ZooKeeper's limit of 60 connections per client IP
applies) or a ``redis-server`` on a free port, and runs
``t/integration/test_tasks.py``, ``test_canvas.py`` and ``test_inspect.py``
with broker and result backend on it. Celery's suite runs its worker inside
the pytest process (``celery_session_worker``, a prefork pool). A
``redis-server`` runs in both cases: some tests record what happened in Redis
(a side channel, as in Celery's own CI); tests that need the Redis *backend*
skip themselves on zk.

No reruns: pytest-rerunfailures is not installed, so the suites' ``flaky``
marks are inert and a flaky failure is seen.

The pass bar (``--check``): every test that fails on ``zk`` is listed in
``tests/upstream/celery_redis_failures.txt``, the tests that fail on Redis
in this same script (or that Celery's suite itself marks as failing there,
``xfail``), each with its reason. ``--broker redis`` makes that list anew
(``--write-expected``).

Usage::

    .venv/bin/python tests/upstream/celery_suite.py [--broker zk|redis] [--check]
        [--write-expected] [--junit FILE] [-- PYTEST ARGS...]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from suites import ROOT, check, failures, read_expected, say, sdist_tests

HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "celery_redis_failures.txt"
SUITES = ("t/integration/test_tasks.py", "t/integration/test_canvas.py",
          "t/integration/test_inspect.py")
#: A wedged test fails after this long instead of stalling the whole run.
TEST_TIMEOUT = 180
TAG = "celery-suite"


def celery_tests() -> Path:
    """Celery's ``t/`` package and pytest settings, from the installed Celery's sdist."""
    import celery

    return sdist_tests("celery", celery.__version__, ("t", "pyproject.toml"))


def run_suites(sdist: Path, broker: str, backend: str, redis_port: int, junit: Path,
               pytest_args: list[str]) -> int:
    # Some tests record what happened in Redis (a side channel, as in Celery's CI,
    # where the broker is RabbitMQ): REDIS_PORT points them at ours.
    env = dict(os.environ, TEST_BROKER=broker, TEST_BACKEND=backend,
               REDIS_HOST="127.0.0.1", REDIS_PORT=str(redis_port))
    # Celery's pytest plugin ships without an entry point (pytest-celery has it).
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "celery.contrib.pytest",
            f"--timeout={TEST_TIMEOUT}", f"--junitxml={junit}", "-q", "-ra",
            *SUITES, *pytest_args]
    say(TAG, f"pytest {' '.join(SUITES)}  (TEST_BROKER={broker})")
    return subprocess.run(args, cwd=sdist, env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=("zk", "redis"), default="zk")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless every failure is one Redis has too")
    parser.add_argument("--write-expected", action="store_true",
                        help="with --broker redis: rewrite the list of Redis's failures")
    parser.add_argument("--junit", type=Path, help="keep the JUnit report here")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()

    sdist = celery_tests()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"celery-suite-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    junit = args.junit or work / "junit.xml"
    started = time.monotonic()
    sys.path.insert(0, str(ROOT / "benchmarks"))   # the benchmarks' import root
    from common.processes import Processes  # the benchmarks' launcher, stopped by pid
    from common.servers import RedisServer

    procs = Processes()
    try:
        redis_server = RedisServer(procs, str(work)).start()
        if args.broker == "zk":
            from celery_zk.server import ZooKeeperServer

            with ZooKeeperServer() as zk:   # ZooKeeper's defaults: maxClientCnxns=60
                url = f"{zk.url}/celery-suite"
                rc = run_suites(sdist, url, url, redis_server.port, junit, args.pytest_args)
        else:
            rc = run_suites(sdist, redis_server.url(0), redis_server.url(1), redis_server.port,
                            junit, args.pytest_args)
        say(TAG, f"pytest exited {rc} after {time.monotonic() - started:.0f} s")
        if not junit.exists():
            say(TAG, "no JUnit report: pytest did not run")
            return 1
        failed = failures(junit)
        if args.write_expected:
            if args.broker != "redis":
                raise SystemExit("--write-expected takes --broker redis")
            write_expected(failures(junit, xfailed=True))
        if not args.check:
            return rc
        return check(TAG, failed, read_expected(EXPECTED))
    finally:
        procs.stop_all()
        if args.junit is None:
            shutil.rmtree(work, ignore_errors=True)


def write_expected(failed: dict[str, str]) -> None:
    old = read_expected(EXPECTED) if EXPECTED.exists() else {}
    lines = [
        "# Tests of Celery's integration suites that fail on Redis too, made by",
        "# `tests/upstream/celery_suite.py --broker redis --write-expected`.",
        "# One per line: test id, then '  # ' and why it fails there. A zk run passes",
        "# when each of its failures is listed here.",
    ]
    for test_id in sorted(failed):
        reason = old.get(test_id) or failed[test_id]
        lines.append(f"{test_id}  # {reason}")
    EXPECTED.write_text("\n".join(lines) + "\n")
    say(TAG, f"wrote {len(failed)} expected failure(s) to {EXPECTED}")


if __name__ == "__main__":
    raise SystemExit(main())
