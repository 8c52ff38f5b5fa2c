"""celery_zk's pytest fixtures, run the way a user's test suite runs them."""
from __future__ import annotations

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
