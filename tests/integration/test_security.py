"""Security on real ZooKeeper servers: digest auth and ACLs, TLS, masked
passwords, the backend's URL grammar, and the opt-in cloudpickle serializer."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import kombu.pools
import pytest
from celery import Celery
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.protocol.paths import join
from kazoo.security import make_digest_acl
from kombu import Connection

from celery_zk.backend import ZooKeeperBackend
from celery_zk.exceptions import ZKAuthError, ZKConfigurationError, ZKConnectionError
from celery_zk.pytest_plugin import kazoo_client
from celery_zk.server import TLSConfig, ZooKeeperServer, free_ports
from celery_zk.zk.client import make_client
from celery_zk.zk.config import parse_url
from celery_zk.zk.layout import Layout

from .queues import body_path, first_bucket_path, waiting_paths
from .workers import Worker, celery_cli, read_log, run_example

TASK = "proj.app."
ALICE_PW = "alice-pw-Zq7"
BOB_PW = "bob-pw-Kx3"
SECRET = "s3cr3t-Pw9"  # must never show up in any output
REPO = Path(__file__).resolve().parents[2]


# -- helpers --------------------------------------------------------------------
kazoo = kazoo_client


def walk(client: KazooClient, path: str) -> list[str]:
    """Every node at and below ``path``."""
    nodes = [path]
    for child in client.get_children(path):
        nodes += walk(client, join(path, child))
    return nodes


def client_app(broker: str, backend: str | None = None) -> Celery:
    app = Celery("client", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(broker_connection_retry_on_startup=True)
    return app


def close_app(app: Celery) -> None:
    if isinstance(app.backend, ZooKeeperBackend):
        app.backend.close()
    app.close()
    kombu.pools.reset()  # app.close() leaves pooled producers connected


@pytest.fixture
def open_chroot(zookeeper_server: Any, zk_chroot: str, zk_client: KazooClient) -> str:
    """``host:port/chroot`` whose chroot exists with the open ACL (``zk_client`` made it),
    so a root below it gets exactly the ACL celery_zk gives it."""
    return f"{zookeeper_server.hosts}{zk_chroot}"


# -- digest auth and ACLs ---------------------------------------------------------
def test_acl_protects_every_node(open_chroot: str, start_worker: Callable[..., Worker],
                                 task_log: Path) -> None:
    hosts, _, chroot = open_chroot.partition("/")
    root = f"/{chroot}/app"
    url = f"zk://alice:{ALICE_PW}@{hosts}{root}?read_only_users=bob:{BOB_PW}"
    worker = start_worker(url, backend=url, log=task_log)
    app = client_app(url, url)
    try:
        assert app.send_task(TASK + "add", (2, 3)).get(timeout=30) == 5
        result_id = app.send_task(TASK + "add", (4, 5)).id
        assert app.AsyncResult(result_id).get(timeout=30) == 9
        # A message nobody consumes stays in its queue for the checks below.
        app.send_task(TASK + "record", ("parked",), queue="parked")
    finally:
        close_app(app)

    layout = Layout(root)
    with kazoo(hosts, f"alice:{ALICE_PW}") as alice:
        nodes = walk(alice, root)
        messages = waiting_paths(alice, layout, "parked")
        messages += [body_path(layout, "parked", path.rpartition("/")[2]) for path in messages]
        parked_bucket = first_bucket_path(alice, layout, "parked")
        bindings = [join(layout.bindings(e), b)
                    for e in alice.get_children(layout.exchanges)
                    for b in alice.get_children(layout.bindings(e))]
        result = layout.result(result_id)
        consumers = [join(layout.consumers, n) for n in alice.get_children(layout.consumers)]
        assert len(messages) == 2 and result in nodes   # its name and its body
        assert bindings and consumers  # the worker's bindings and session node are live
        expected = [make_digest_acl("alice", ALICE_PW, all=True),
                    make_digest_acl("bob", BOB_PW, read=True)]
        wrong_acl = {n: alice.get_acls(n)[0] for n in nodes
                     if alice.get_acls(n)[0] != expected}
        assert not wrong_acl, f"nodes without celery_zk's ACL: {wrong_acl}"
    assert "parked" not in [e["value"] for e in read_log(task_log)]

    # Neither an unauthenticated client nor a wrong password reads or writes anything.
    for auth in (None, f"alice:{ALICE_PW}x"):
        with kazoo(hosts, auth) as outsider:
            for node in (*messages, *bindings, result, *consumers, root,
                         layout.queues, layout.results):
                with pytest.raises(NoAuthError):
                    outsider.get(node)
                with pytest.raises(NoAuthError):
                    outsider.get_children(node)
            for queue_dir in (layout.unowned("parked"), parked_bucket,
                              layout.unowned("celery"), layout.owned("celery"), layout.results):
                with pytest.raises(NoAuthError):
                    outsider.create(join(queue_dir, "m0-ffff-0000000000"), b"{}")
            with pytest.raises(NoAuthError):
                outsider.set(messages[0], b"tampered")
            with pytest.raises(NoAuthError):
                outsider.delete(messages[0])

    # bob (read_only_users) reads everything but changes nothing.
    with kazoo(hosts, f"bob:{BOB_PW}") as bob:
        assert b"parked" in bob.get(messages[1])[0]
        assert json.loads(bob.get(result)[0])["result"] == 9
        for node in (*bindings, root):
            bob.get(node)
        assert bob.get_children(parked_bucket)
        with pytest.raises(NoAuthError):
            bob.create(join(parked_bucket, "m0-ffff-0000000000"), b"{}")
        for message in messages:
            with pytest.raises(NoAuthError):
                bob.set(message, b"tampered")
            with pytest.raises(NoAuthError):
                bob.delete(message)
        with pytest.raises(NoAuthError):
            bob.delete(result)
    # And the messages bob could not touch are intact.
    with kazoo(hosts, f"alice:{ALICE_PW}") as alice:
        assert b"parked" in alice.get(messages[1])[0]
        assert alice.exists(messages[0]) is not None
    worker.stop()
    assert ALICE_PW not in worker.output() and BOB_PW not in worker.output()


def test_wrong_password_fails_at_connect_naming_the_user(open_chroot: str) -> None:
    hosts, _, chroot = open_chroot.partition("/")
    good = f"zk://alice:{ALICE_PW}@{hosts}/{chroot}/app"
    with Connection(good) as conn:  # makes the root, with alice's ACL
        conn.connect()
    for bad in (f"zk://alice:WRONG-{ALICE_PW}@{hosts}/{chroot}/app",
                f"zk://mallory:{ALICE_PW}@{hosts}/{chroot}/app"):
        user = parse_url(bad).username
        started = time.monotonic()
        with Connection(bad) as conn, pytest.raises(ZKAuthError) as broker_err:
            conn.connect()
        assert time.monotonic() - started < 10
        app = client_app(bad, bad)
        try:
            with pytest.raises(ZKAuthError) as backend_err:
                app.backend.get_task_meta("some-task-id")
        finally:
            close_app(app)
        for err in (broker_err, backend_err):
            assert f"user {user!r}" in str(err.value) and "password" in str(err.value)
            assert ALICE_PW not in str(err.value)
    # No credentials at all: refused too, and said so.
    with Connection(f"zk://{hosts}/{chroot}/app") as conn, \
            pytest.raises(ZKAuthError, match="unauthenticated client"):
        conn.connect()


# -- passwords never reach output; the backend takes the broker's grammar ----------
def test_passwords_never_appear_in_worker_output(
        zookeeper_server: Any, open_chroot: str, start_worker: Callable[..., Worker],
        task_log: Path) -> None:
    hosts, _, chroot = open_chroot.partition("/")
    port = hosts.rpartition(":")[2]
    path = f"/{chroot}/app"
    readers = f"read_only_users=bob:{SECRET}"
    # Broker: kombu's failover form. Backend: a comma host list with options.
    broker = (f"zk://alice:{SECRET}@127.0.0.1:{port}{path};"
              f"zk://alice:{SECRET}@localhost:{port}{path}?session_timeout=8&{readers}")
    backend = (f"zk://alice:{SECRET}@127.0.0.1:{port},localhost:{port}{path}"
               f"?connect_timeout=5&{readers}")
    worker = start_worker(broker, backend=backend, log=task_log,
                          extra_args=["--loglevel=DEBUG"])
    app = client_app(broker, backend)
    try:
        assert repr(app.backend) == (
            f"<ZooKeeperBackend: zk://alice:**@127.0.0.1:{port},localhost:{port}{path}>")
        assert app.backend.settings.options.connect_timeout == 5.0
        assert app.send_task(TASK + "add", (20, 22)).get(timeout=30) == 42
        ok = app.send_task(TASK + "record", ("logged",))
        failed = app.send_task(TASK + "fail", ("boom",))
        ok.get(timeout=30)
        with pytest.raises(ValueError):
            failed.get(timeout=30)
        for text in (repr(app.backend), app.backend.as_uri(), app.connection().as_uri()):
            assert SECRET not in text
    finally:
        close_app(app)
    # celery's own masking of result_backend (kombu's sanitize_url) does not know
    # celery_zk's password options: see test_celery_cli_masks_passwords.
    report = celery_cli(["report"], broker,
                        env={"CELERY_ZK_TEST_BACKEND": backend.replace(readers, "")})
    assert report.returncode == 0, report.stderr
    assert "alice:**@" in report.stdout
    worker.stop()
    out = worker.output()
    assert f"alice:**@127.0.0.1:{port}{path}" in out  # the banner's (masked) broker URL
    assert "results:" in out and "zk://alice:**@" in out.split("results:", 1)[1]
    assert "bob:**" in out
    for text in (out, report.stdout, report.stderr, zookeeper_server.read_log()):
        assert SECRET not in text


@pytest.mark.parametrize("command", ["inspect stats", "report"])
def test_celery_cli_masks_passwords(command: str, open_chroot: str,
                                    start_worker: Callable[..., Worker]) -> None:
    hosts, _, chroot = open_chroot.partition("/")
    url = f"zk://alice:{SECRET}@{hosts}/{chroot}/app?read_only_users=bob:{SECRET}"
    env = {"CELERY_ZK_TEST_BACKEND": url}
    if command == "inspect stats":
        start_worker(url)
        args = ["inspect", "stats", "--json", "--timeout=10"]
    else:
        args = ["report"]
    proc = celery_cli(args, url, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert SECRET not in proc.stdout + proc.stderr


def test_backend_url_errors_name_the_problem(open_chroot: str) -> None:
    hosts, _, chroot = open_chroot.partition("/")
    base = f"zk://alice:{SECRET}@{hosts}/{chroot}/app"
    for url, fragment in ((f"{base}?sesion_timeout=3", "'sesion_timeout'"),
                          (f"{base}?connect_timeout=soon", "'connect_timeout'"),
                          (f"zk://alice:{SECRET}@{hosts},,h2/{chroot}", "Empty host"),
                          (f"zk://alice:{SECRET}@{hosts}:99999/x", "Malformed host")):
        app = client_app(base, url)
        try:
            with pytest.raises(ZKConfigurationError, match=fragment) as err:
                app.backend  # noqa: B018 - the backend is made (and its URL parsed) here
            assert SECRET not in str(err.value)
        finally:
            app.close()
        with pytest.raises(ZKConfigurationError, match=fragment) as err:
            Connection(url).connect()
        assert SECRET not in str(err.value)


# -- TLS ----------------------------------------------------------------------------
@dataclass(frozen=True)
class TLSFiles:
    ca: Path
    client_cert: Path
    client_key: Path
    server: TLSConfig

    def query(self, client_cert: bool = True) -> str:
        query = f"use_ssl=true&ca={self.ca}"
        if client_cert:
            query += f"&certfile={self.client_cert}&keyfile={self.client_key}"
        return query


def _run(*cmd: str | Path) -> None:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if proc.returncode:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed:\n{proc.stderr}")


def make_tls_files(directory: Path) -> TLSFiles:
    """A throwaway CA, a server and a client certificate (openssl), and the server's
    PKCS12 key store and trust store (openssl and Java's keytool)."""
    for tool in ("openssl", "keytool"):
        if shutil.which(tool) is None:
            pytest.fail(f"the TLS tests need {tool!r} on PATH (openssl; keytool comes "
                        "with the Java runtime ZooKeeper runs on)", pytrace=False)
    d = directory
    _run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=celery_zk test CA", "-keyout", d / "ca.key", "-out", d / "ca.pem")
    for who in ("server", "client"):
        (d / f"{who}.ext").write_text(
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n")
        _run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}",
             "-keyout", d / f"{who}.key", "-out", d / f"{who}.csr")
        _run("openssl", "x509", "-req", "-in", d / f"{who}.csr", "-CA", d / "ca.pem",
             "-CAkey", d / "ca.key", "-CAcreateserial", "-days", "2",
             "-extfile", d / f"{who}.ext", "-out", d / f"{who}.pem")
    _run("openssl", "pkcs12", "-export", "-in", d / "server.pem", "-inkey", d / "server.key",
         "-certfile", d / "ca.pem", "-name", "server", "-passout", "pass:keystore-pw",
         "-out", d / "keystore.p12")
    # A trust store needs keytool: Java ignores certificates in an openssl-made PKCS12
    # that lack its "trusted" attribute.
    _run("keytool", "-importcert", "-noprompt", "-alias", "ca", "-file", d / "ca.pem",
         "-keystore", d / "truststore.p12", "-storetype", "PKCS12",
         "-storepass", "truststore-pw")
    return TLSFiles(ca=d / "ca.pem", client_cert=d / "client.pem", client_key=d / "client.key",
                    server=TLSConfig(str(d / "keystore.p12"), "keystore-pw",
                                     str(d / "truststore.p12"), "truststore-pw",
                                     client_auth="need", store_type="PKCS12"))


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_server(tls_files: TLSFiles) -> Iterator[ZooKeeperServer]:
    """A TLS-only ZooKeeper (no plaintext port) that requires client certificates."""
    server = ZooKeeperServer(secure_port=free_ports(1)[0], tls=tls_files.server,
                             plaintext=False)
    with server:
        yield server


@pytest.fixture
def tls_url(tls_server: ZooKeeperServer, tls_files: TLSFiles, zk_chroot: str) -> str:
    return f"zk://{tls_server.hosts}{zk_chroot}?{tls_files.query()}"


def test_tls_kombu_round_trip(tls_server: ZooKeeperServer, tls_url: str,
                              tls_files: TLSFiles) -> None:
    assert tls_server.port is None  # TLS only: there is no plaintext port to fall back on
    with Connection(tls_url) as conn:
        queue = conn.SimpleQueue("tls-roundtrip")
        queue.put({"hello": "tls"})
        message = queue.get(timeout=10)
        assert message.payload == {"hello": "tls"}
        message.ack()
        queue.close()
    # The same options also work as broker_transport_options.
    options = dict(use_ssl=True, ca=str(tls_files.ca), certfile=str(tls_files.client_cert),
                   keyfile=str(tls_files.client_key))
    with Connection(tls_url.partition("?")[0], transport_options=options) as conn:
        conn.connect()


def test_tls_celery_task_with_result(tls_url: str, start_worker: Callable[..., Worker]) -> None:
    start_worker(tls_url, backend=tls_url)
    app = client_app(tls_url, tls_url)
    try:
        assert app.send_task(TASK + "add", (40, 2)).get(timeout=30) == 42
    finally:
        close_app(app)


@pytest.mark.parametrize("client", ["plaintext", "no-client-cert"])
def test_tls_only_server_refuses_other_clients_within_connect_timeout(
        client: str, tls_server: ZooKeeperServer, tls_files: TLSFiles,
        zk_chroot: str) -> None:
    query = "connect_timeout=3"
    if client == "no-client-cert":
        query += "&" + tls_files.query(client_cert=False)
    url = f"zk://{tls_server.hosts}{zk_chroot}?{query}"
    started = time.monotonic()
    with pytest.raises(ZKConnectionError) as err:
        make_client(parse_url(url))
    assert time.monotonic() - started < 3 + 2
    assert tls_server.hosts in str(err.value) and "within 3s" in str(err.value)
    assert "use_ssl=true" in str(err.value)  # says what to check in either case
    # kombu's connect() retries once before it gives up, with the same error.
    with Connection(url) as conn, pytest.raises(ZKConnectionError, match="use_ssl=true"):
        conn.connect()


# -- cloudpickle ----------------------------------------------------------------------
def test_cloudpickle_lambda_runs_only_where_accepted(
        zk_url: str, start_worker: Callable[..., Worker], task_log: Path) -> None:
    conf = {"accept_content": ["json", "cloudpickle"]}
    trusting = start_worker(zk_url, backend=zk_url, log=task_log, queues="trusting",
                            name="trusting", env={"CELERY_ZK_TEST_CONF": json.dumps(conf)})
    strict = start_worker(zk_url, backend=zk_url, log=task_log, queues="strict",
                          name="strict")
    app = client_app(zk_url, zk_url)
    base = 100
    try:
        lam = app.send_task(TASK + "call", (lambda x: x * 2, 21), serializer="cloudpickle",
                            queue="trusting")
        closure = app.send_task(TASK + "call", (lambda x: x + base, 1),
                                serializer="cloudpickle", queue="trusting")
        assert lam.get(timeout=30) == 42 and closure.get(timeout=30) == 101
        app.send_task(TASK + "call", (lambda: "must not run",), serializer="cloudpickle",
                      queue="strict")
        strict.wait_for("ContentDisallowed", timeout=30)
        # It is not redelivered: the worker drops what it may not decode.
        app.send_task(TASK + "record", ("after",), queue="strict").get(timeout=30)
    finally:
        close_app(app)
    values = [e["value"] for e in read_log(task_log)]
    assert sorted(map(str, values)) == ["101", "42", "after"]
    assert "must not run" not in strict.output() + trusting.output()


def test_cloudpickle_example_runs() -> None:
    proc = run_example("cloudpickle_example")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result: 42" in proc.stdout
