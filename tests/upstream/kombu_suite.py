"""Run kombu's own integration suite against the zk:// transport.

kombu tests each transport with the same base classes (``t/integration/
common.py``: connecting, publishing and consuming, exchange types, priority,
acks and rejects, failover, the event loop); each transport's module binds
them to a server. This fetches that file from the sdist of the *installed*
kombu (once, into ``.cache/``), writes the zk module beside it (the classes
bound to a ZooKeeper with its default settings, started here), and runs it.

No reruns: kombu marks these tests ``flaky`` for its own CI; without
pytest-rerunfailures the mark is inert and a flaky failure is seen.

The pass bar (``--check``): every failure is listed in
``tests/upstream/kombu_zk_failures.txt`` with its reason.

Usage::

    .venv/bin/python tests/upstream/kombu_suite.py [--check] [-- PYTEST ARGS...]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from suites import check, failures, read_expected, say, sdist_tests

HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "kombu_zk_failures.txt"
TEST_TIMEOUT = 120
TAG = "kombu-suite"

#: kombu's base classes bound to zk://, as kombu's test_redis.py binds them to Redis.
ZK_MODULE = '''\
"""kombu's integration base classes on zk:// (written by celery_zk's kombu_suite.py)."""
from __future__ import annotations

import os
import socket

import pytest

import celery_zk  # noqa: F401  (registers zk:// with kombu)
import kombu

from .common import (BaseEventLoop, BaseExchangeTypes, BaseFailover, BaseMessage,
                     BasePriority, BasicFunctionality)

URL = os.environ["KOMBU_ZK_URL"]
DEAD_URL = os.environ["KOMBU_ZK_DEAD_URL"]


@pytest.fixture()
def connection():
    return kombu.Connection(URL)


@pytest.fixture()
def invalid_connection():
    return kombu.Connection(DEAD_URL)


@pytest.fixture()
def failover_connection():
    return kombu.Connection(f"{DEAD_URL};{URL}")


class test_ZKBasicFunctionality(BasicFunctionality):
    pass


class test_ZKBaseExchangeTypes(BaseExchangeTypes):
    pass


class test_ZKPriority(BasePriority):
    """Higher numbers first, as AMQP (PRIORITY_ORDER 'asc'). kombu's base test
    drains once for three messages, as py-amqp delivers them; a virtual
    transport delivers one message per drain_events, so kombu's Redis module
    repeats the call in copies of these tests. Here each drain_events drains
    until nothing more comes, and kombu's own test bodies run unchanged."""

    @pytest.fixture()
    def connection(self, connection):
        drain_one = connection.drain_events

        def drain_all(**kwargs):
            drain_one(**kwargs)
            while True:
                try:
                    drain_one(timeout=0.5)
                except socket.timeout:
                    return

        connection.drain_events = drain_all
        return connection


class test_ZKFailover(BaseFailover):
    pass


class test_ZKMessage(BaseMessage):
    pass


class test_ZKEventLoop(BaseEventLoop):
    pass
'''


def kombu_tests() -> Path:
    import kombu

    tests = sdist_tests("kombu", kombu.__version__, ("t", "setup.cfg"))
    (tests / "t" / "integration" / "test_zk.py").write_text(ZK_MODULE)
    return tests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless every failure is listed with its reason")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()

    from celery_zk.server import ZooKeeperServer, free_ports

    tests = kombu_tests()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"kombu-suite-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    junit = work / "junit.xml"
    started = time.monotonic()
    try:
        with ZooKeeperServer() as zk:   # ZooKeeper's defaults
            env = dict(os.environ, KOMBU_ZK_URL=f"{zk.url}/kombu-suite",
                       KOMBU_ZK_DEAD_URL=f"zk://127.0.0.1:{free_ports()[0]}/kombu-suite")
            command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                       f"--timeout={TEST_TIMEOUT}",
                       f"--junitxml={junit}", "-q", "-ra", "t/integration/test_zk.py",
                       *args.pytest_args]
            say(TAG, "pytest t/integration/test_zk.py (kombu's common.py on zk://)")
            rc = subprocess.run(command, cwd=tests, env=env).returncode
        say(TAG, f"pytest exited {rc} after {time.monotonic() - started:.0f} s")
        if not junit.exists():
            say(TAG, "no JUnit report: pytest did not run")
            return 1
        if not args.check:
            return rc
        return check(TAG, failures(junit), read_expected(EXPECTED))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
