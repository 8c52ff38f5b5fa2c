"""pytest fixtures for testing Celery apps against a real ZooKeeper, loaded
automatically (``pytest11`` entry point) wherever celery_zk is installed:
``zookeeper_server`` (or ``CELERY_ZK_TEST_HOSTS``'s existing server) and, per
test, a fresh chroot (``zk_chroot``, ``zk_hosts``, ``zk_url``, ``zk_client``).
A failed test's report gets the server log's tail. A missing ZooKeeper fails
the tests instead of skipping them, so a CI job without ZooKeeper cannot pass
by silently testing nothing. See ``docs/testing.md``, "Fixtures" and "No
ZooKeeper means failure, not a skip".
"""
from __future__ import annotations

import os
import re
import signal
import threading
import uuid
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import pytest

if TYPE_CHECKING:
    from kazoo.client import KazooClient

__all__ = ["ExternalZooKeeper", "zk_chroot", "zk_client", "zk_hosts", "zk_url",
           "zookeeper_server"]

HOSTS_ENV = "CELERY_ZK_TEST_HOSTS"
CHROOT_BASE = "/celery-zk-test"
LOG_SECTION = "zookeeper server log"
LOG_TAIL_LINES = 100


class _Server(Protocol):
    @property
    def hosts(self) -> str: ...

    @property
    def url(self) -> str: ...

    def read_log(self, last_lines: int | None = None) -> str: ...


class ExternalZooKeeper:
    """A server we did not launch (``CELERY_ZK_TEST_HOSTS``): no log to show."""

    def __init__(self, hosts: str) -> None:
        self.hosts = hosts
        self.url = f"zk://{hosts}"

    def read_log(self, last_lines: int | None = None) -> str:
        return f"(ZooKeeper at {self.hosts} comes from ${HOSTS_ENV}; its log is not ours)\n"


_SERVER = pytest.StashKey[_Server]()


@pytest.fixture(scope="session")
def zookeeper_server(request: pytest.FixtureRequest) -> Iterator[_Server]:
    hosts = os.environ.get(HOSTS_ENV, "").strip()
    if hosts:
        server: _Server = ExternalZooKeeper(hosts)
        request.config.stash[_SERVER] = server
        yield server
        return
    # Imported here so merely having celery_zk installed keeps pytest start-up light.
    from celery_zk.exceptions import ServerStartError, ZooKeeperNotInstalled
    from celery_zk.server import ZooKeeperServer

    try:
        launched = ZooKeeperServer()
        launched.start()
    except (ZooKeeperNotInstalled, ServerStartError) as exc:
        pytest.fail(f"celery_zk's zookeeper_server fixture cannot start ZooKeeper:\n{exc}",
                    pytrace=False)
    request.config.stash[_SERVER] = launched
    previous = _interrupt_on_sigterm()
    try:
        yield launched
    finally:
        # Pooled connections (kombu keeps pools for the life of a process) would
        # otherwise outlive the server and retry against it until exit.
        from celery_zk.zk.session import close_all

        close_all(launched.hosts)
        launched.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt("pytest received SIGTERM")


def _interrupt_on_sigterm() -> Any:
    """Make SIGTERM end the run as Ctrl-C does; returns the handler it replaced.

    A killed run (``timeout``, a CI job cancelled) otherwise dies without
    tearing fixtures down, and the ZooKeeper server and workers outlive it.
    Only from the main thread, and only over the default handler.
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        return None
    return signal.signal(signal.SIGTERM, _on_sigterm)


@pytest.fixture
def zk_chroot(request: pytest.FixtureRequest) -> str:
    """``/celery-zk-test/<test name>-<8 hex>``: unique, and readable in a znode dump."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-.")[:80]
    return f"{CHROOT_BASE}/{name or 'test'}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def zk_hosts(zookeeper_server: _Server, zk_chroot: str) -> str:
    """``host:port/chroot`` for ``KazooClient(hosts=...)``."""
    return f"{zookeeper_server.hosts}{zk_chroot}"


@pytest.fixture
def zk_url(zookeeper_server: _Server, zk_chroot: str) -> str:
    """``zk://host:port/chroot`` for ``broker_url`` / ``result_backend``."""
    return f"{zookeeper_server.url}{zk_chroot}"


@contextmanager
def kazoo_client(hosts: str, auth: str | None = None, **kwargs: Any) -> Iterator[KazooClient]:
    """A started kazoo client (digest-authenticated as ``user:password`` if given)."""
    from kazoo.client import KazooClient

    client = KazooClient(hosts=hosts, auth_data=[("digest", auth)] if auth else None,
                         **kwargs)
    client.start(timeout=15)
    try:
        yield client
    finally:
        client.stop()
        client.close()


@pytest.fixture
def zk_client(zookeeper_server: _Server, zk_chroot: str,
              zk_hosts: str) -> Iterator[KazooClient]:
    # A chrooted client cannot create its own root: make it from outside first.
    with kazoo_client(zookeeper_server.hosts) as root:
        root.ensure_path(zk_chroot)
    with kazoo_client(zk_hosts) as client:
        yield client


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.failed or "zookeeper_server" not in getattr(item, "fixturenames", ()):
        return
    server = item.config.stash.get(_SERVER, None)
    if server is not None:
        report.sections.append((LOG_SECTION, server.read_log(last_lines=LOG_TAIL_LINES)))
