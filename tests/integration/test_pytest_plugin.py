"""celery_zk's pytest fixtures, run the way a user's test suite runs them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest_plugins = ["pytester"]

USER_TESTS = '''
from kazoo.client import KazooClient

def test_writes_node(zk_client, zk_hosts, zk_url, zk_chroot):
    assert zk_url.startswith("zk://127.0.0.1:") and zk_url.endswith(zk_chroot)
    assert zk_chroot.startswith("/celery-zk-test/test_writes_node-")
    zk_client.create("/node", b"hello")
    other = KazooClient(hosts=zk_hosts)
    other.start()
    assert other.get("/node")[0] == b"hello"
    other.stop()
    other.close()

def test_chroots_are_separate(zk_client):
    assert not zk_client.exists("/node")

def test_fails(zk_client):
    zk_client.create("/doomed", b"")
    assert False, "deliberate failure"

def test_fails_without_zookeeper():
    assert False, "no zookeeper here"
'''


def test_fixtures_and_log_on_failure(pytester: pytest.Pytester,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CELERY_ZK_TEST_HOSTS", raising=False)  # we want our own server's log
    pytester.makepyfile(test_user=USER_TESTS)
    # In a subprocess: the session server must start and stop inside that run.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    output = result.stdout.str()
    sections = output.split("_ test_")
    fails = next(s for s in sections if s.startswith("fails _"))
    assert "zookeeper server log" in fails
    assert "org.apache.zookeeper" in fails  # the log itself, not just a header
    unrelated = next(s for s in sections if s.startswith("fails_without_zookeeper"))
    assert "zookeeper server log" not in unrelated


def test_missing_zookeeper_fails_not_skips(pytester: pytest.Pytester,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZOOKEEPER_HOME", str(pytester.path / "no-zookeeper-here"))
    pytester.makepyfile(test_user="def test_needs_zk(zk_url):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*sudo apt-get install zookeeper*"])
    assert "skipped" not in result.stdout.str()


SLOW_USER_TEST = """
import os, time

def test_waits(zookeeper_server):
    with open(os.environ["ZK_PID_FILE"] + ".tmp", "w") as fh:
        fh.write(str(zookeeper_server._proc.pid))
    os.replace(os.environ["ZK_PID_FILE"] + ".tmp", os.environ["ZK_PID_FILE"])
    time.sleep(120)
"""


def test_a_run_killed_with_sigterm_stops_its_zookeeper(pytester: pytest.Pytester,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``timeout`` and cancelled CI jobs send SIGTERM: the server must not outlive the run."""
    monkeypatch.delenv("CELERY_ZK_TEST_HOSTS", raising=False)
    pytester.makepyfile(test_slow=SLOW_USER_TEST)
    pid_file = pytester.path / "zk.pid"
    env = dict(os.environ, ZK_PID_FILE=str(pid_file))
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"],
                           cwd=pytester.path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert run.poll() is None and time.monotonic() < deadline, \
                run.stdout.read().decode() if run.stdout else ""
            time.sleep(0.1)
        zk_pid = int(pid_file.read_text())
        run.send_signal(signal.SIGTERM)
        run.wait(60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    deadline = time.monotonic() + 30
    while _alive(zk_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(zk_pid)
    if alive:
        os.kill(zk_pid, signal.SIGKILL)
    assert not alive, "ZooKeeper outlived the SIGTERMed pytest run"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:   # a zombie is gone too
        return fh.read().split()[2] != "Z"
