"""The operator's commands on a real server: celery zk status, dead, tree, exporter."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from kazoo.client import KazooClient
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_zk.broker.dead import MAGIC, unwrap
from celery_zk.server import four_letter_word
from celery_zk.zk.layout import Layout

from .queues import owned, stored_body, waiting
from .workers import HERE, Worker, celery_cli, wait_until

#: In every cell of the version matrix (tox.ini).
pytestmark = pytest.mark.matrix

LAYOUT = Layout("/")  # zk_client is chrooted at the URL's path
SECRET = "s3cr3t-Pa55"


def queue_of(name: str) -> Queue:
    return Queue(name, Exchange(name, "direct"), name)


def publish(conn: Connection, queue: Queue, bodies: list[Any],
            priority: int | None = None) -> None:
    producer = Producer(conn.channel())
    for body in bodies:
        producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key,
                         declare=[queue], priority=priority, serializer="json")


def status_json(url: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = celery_cli(["zk", "status", "--json", *args], url, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    return lines[0]


def drain_until(conn: Connection, done: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "not delivered in time"
        try:
            conn.drain_events(timeout=0.5)
        except socket.timeout:
            pass


def reject_into_dead(url: str, queue: Queue, count: int) -> None:
    with Connection(url, transport_options={"dead_letter_rejected": True}) as conn:
        got: list[Any] = []

        def on_message(body: Any, message: Any) -> None:
            got.append(body)
            message.reject(requeue=False)

        with Consumer(conn, [queue], callbacks=[on_message], prefetch_count=1):
            drain_until(conn, lambda: len(got) >= count)


def test_status_shows_queues_by_priority_owners_dead_consumers_and_server(
        zk_url: str, zk_client: KazooClient, zookeeper_server: Any) -> None:
    ops = queue_of("ops")
    with Connection(zk_url) as conn:
        publish(conn, ops, [{"n": i} for i in range(20)])
        publish(conn, ops, [{"n": i} for i in range(5)], priority=9)
        publish(conn, queue_of("ops-dead"), [{"d": 1}, {"d": 2}])
    reject_into_dead(zk_url, queue_of("ops-dead"), 2)
    time.sleep(1.1)   # the oldest message has waited at least this long
    with Connection(zk_url) as holder:
        # A consumer that holds 4 messages unacked: owned by it.
        held: list[Any] = []
        consumer = Consumer(holder, [ops], callbacks=[lambda b, m: held.append(m)],
                            prefetch_count=4)
        with consumer:
            drain_until(holder, lambda: len(held) >= 1)
            wait_until(lambda: len(owned(zk_client, LAYOUT, "ops")) == 4, 30)
            report = status_json(zk_url)
            by_name = {q["name"]: q for q in report["queues"]}
            assert by_name["ops"]["waiting"] == 21
            # The consumer took 4 of the 5 of priority 9 first.
            assert by_name["ops"]["waiting_by_priority"] == {"0": 20, "9": 1}
            assert by_name["ops"]["owned"] == 4
            assert by_name["ops"]["oldest_waiting_seconds"] >= 1.0
            assert by_name["ops-dead"]["dead"] == 2 and by_name["ops-dead"]["waiting"] == 0
            [consumer_status] = [c for c in report["consumers"] if c["owned"]]
            assert consumer_status["queues"] == ["ops"]
            assert consumer_status["host"] == socket.gethostname()
            assert by_name["ops"]["owned_by_consumer"] == {consumer_status["id"]: 4}
            # queue_declare(passive=True) counts, as generic exporters read them
            ok = holder.default_channel.queue_declare("ops", passive=True)
            assert (ok.message_count, ok.consumer_count) == (21, 1)
            text = celery_cli(["zk", "status"], zk_url)
            assert text.returncode == 0, text.stderr
            [row] = [line.split() for line in text.stdout.splitlines()
                     if line.startswith("ops ")]
            # QUEUE, WAITING, BY PRIORITY, DELAYED, OWNED, DEAD, IDLE, OLDEST, CHUNKED, LIMITS,
            # EXPIRED/DROPPED
            assert row == ["ops", "21", "9:1", "0:20", "-", "4", "0", "0", row[-4], "-", "-",
                           "0/0"]
    [server] = report["servers"].values()
    host, port = zookeeper_server.hosts.split(",")[0].rsplit(":", 1)
    if "not in the whitelist" in four_letter_word(host, int(port), "mntr"):
        assert "mntr is not allowed" in server["note"]
        assert server["zk_znode_count"] > 0
    else:
        assert server["zk_znode_count"] > 0 and "zk_avg_latency" in server
        assert "zk_watch_count" in server


def test_status_counts_results_and_what_is_past_expiry(
        zk_url: str, zk_client: KazooClient, start_worker: Callable[..., Worker]) -> None:
    env = {"CELERY_ZK_TEST_BACKEND": zk_url}
    start_worker(zk_url, backend=zk_url, pool="threads", concurrency=2)
    script = f"""
import sys; sys.path.insert(0, {str(HERE)!r})
from proj.app import add, app
assert [add.delay(i, i).get(timeout=30) for i in range(3)] == [0, 2, 4]
app.close()
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60,
                   env={**os.environ, "CELERY_ZK_TEST_BROKER": zk_url,
                        "CELERY_ZK_TEST_BACKEND": zk_url})
    results = status_json(zk_url, env=env)["results"]
    assert results["results"] == 3 and results["expired"] == 0
    # An index entry of two hours ago: past a result_expires of one hour.
    hour = int(time.time() // 3600) - 2
    zk_client.create(LAYOUT.expiry_entry(hour, "r", "old-task"), makepath=True)
    conf = {"CELERY_ZK_TEST_CONF": json.dumps({"result_expires": 3600})}
    assert status_json(zk_url, env={**env, **conf})["results"]["expired"] == 1
    conf = {"CELERY_ZK_TEST_CONF": json.dumps({"result_expires": 4 * 3600})}
    assert status_json(zk_url, env={**env, **conf})["results"]["expired"] == 0


def test_bad_input_is_one_clear_line_and_exit_code_1(zk_url: str, zk_hosts: str) -> None:
    with Connection(zk_url) as conn:
        publish(conn, queue_of("known"), [{"x": 1}])
    err = one_line_error(celery_cli(["zk", "status", "nope"], zk_url))
    assert "no queue 'nope'" in err and "known" in err
    err = one_line_error(celery_cli(["zk", "dead", "list", "nope"], zk_url))
    assert "no queue 'nope'" in err
    with socket.socket() as sock:   # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    err = one_line_error(celery_cli(["zk", "status", "--timeout", "2"],
                                    f"zk://127.0.0.1:{free}/x"))
    assert f"127.0.0.1:{free}" in err
    err = one_line_error(celery_cli(["zk", "status"], "redis://127.0.0.1:6379/0"))
    assert "not zk://" in err


def test_a_wrong_password_is_one_clear_line_without_the_password(
        zookeeper_server: Any, zk_chroot: str, zk_client: KazooClient) -> None:
    base = f"{zookeeper_server.hosts}{zk_chroot}/app"
    with Connection(f"zk://alice:{SECRET}@{base}") as conn:
        publish(conn, queue_of("private"), [{"x": 1}])
    done = celery_cli(["zk", "status"], f"zk://alice:WRONG{SECRET}@{base}")
    err = one_line_error(done)
    assert "password" in err and SECRET not in done.stderr + done.stdout


def test_dead_letters_are_listed_with_their_reason_requeued_and_purged(
        zk_url: str, zk_client: KazooClient) -> None:
    q = queue_of("dl")
    with Connection(zk_url) as conn:
        publish(conn, q, [{"n": i} for i in range(4)])
    reject_into_dead(zk_url, q, 4)
    listing = celery_cli(["zk", "dead", "list", "dl", "--json"], zk_url)
    assert listing.returncode == 0, listing.stderr
    letters = json.loads(listing.stdout)
    assert len(letters) == 4
    assert {letter["reason"] for letter in letters} == {"rejected with requeue=False"}
    assert all(letter["host"] == socket.gethostname() and letter["at"] for letter in letters)
    # The dead node keeps the message's bytes behind the reason line.
    name = letters[0]["id"]
    header, message = unwrap(zk_client.get(LAYOUT.dead_message("dl", name))[0])
    assert header["reason"] == "rejected with requeue=False"
    assert json.loads(message)["body"]
    text = celery_cli(["zk", "dead", "list", "dl"], zk_url).stdout
    assert "rejected with requeue=False" in text and "4 dead letter(s)" in text

    one = celery_cli(["zk", "dead", "requeue", "dl", name], zk_url)
    assert one.returncode == 0, one.stderr
    assert f"requeued {name}" in one.stdout
    assert len(waiting(zk_client, LAYOUT, "dl")) == 1
    stored = stored_body(zk_client, LAYOUT, "dl", waiting(zk_client, LAYOUT, "dl")[0])
    assert not stored[0].startswith(MAGIC) and stored[0] == message   # as it was

    err = one_line_error(celery_cli(["zk", "dead", "requeue", "dl", name], zk_url))
    assert f"no dead letter {name!r}" in err   # already requeued: said, nothing changed
    rest = celery_cli(["zk", "dead", "requeue", "dl", "--all"], zk_url)
    assert rest.returncode == 0, rest.stderr
    assert rest.stdout.count("requeued ") == 3 and "0 dead letters left" in rest.stdout
    with Connection(zk_url) as conn:   # they are delivered again
        got: list[Any] = []
        with Consumer(conn, [q], callbacks=[lambda b, m: (got.append(b), m.ack())]):
            drain_until(conn, lambda: len(got) >= 4)
    assert sorted(b["n"] for b in got) == [0, 1, 2, 3]

    with Connection(zk_url) as conn:
        publish(conn, q, [{"n": 9}, {"n": 10}])
    reject_into_dead(zk_url, q, 2)
    purged = celery_cli(["zk", "dead", "purge", "dl", "-f"], zk_url)
    assert purged.returncode == 0, purged.stderr
    assert "purged 2 dead letter(s)" in purged.stdout
    assert zk_client.get_children(LAYOUT.dead("dl")) == []


def test_upgrade_stores_a_message_of_0_1_anew_and_then_finds_nothing(
        zk_url: str, zk_client: KazooClient) -> None:
    """`celery zk upgrade` as an operator runs it (the forms it knows:
    test_dispatch.py); run again, it says there is nothing to do."""
    q = queue_of("old")
    with Connection(zk_url) as conn:
        q(conn.channel()).declare()
    zk_client.create(f"{LAYOUT.unowned('old')}/m9-{'a' * 16}-", b"{}", sequence=True)
    first = celery_cli(["zk", "upgrade"], zk_url)
    assert first.returncode == 0, first.stderr
    assert first.stdout == "old: 1 message(s) stored anew\n"
    assert len(waiting(zk_client, LAYOUT, "old")) == 1
    again = celery_cli(["zk", "upgrade"], zk_url)
    assert again.returncode == 0 and again.stdout == "nothing to upgrade\n", again.stderr


def test_a_foreign_dead_letter_cannot_be_requeued_and_says_what_to_do(
        zk_url: str, zk_client: KazooClient) -> None:
    with Connection(zk_url) as conn:
        publish(conn, queue_of("junk"), [{"ok": 1}])
    zk_client.create(LAYOUT.dead("junk") + "/not-a-message", b"hello", makepath=True)
    listing = json.loads(celery_cli(["zk", "dead", "list", "junk", "--json"], zk_url).stdout)
    assert listing[0]["reason"].startswith("unknown")   # written without a reason line
    err = one_line_error(celery_cli(["zk", "dead", "requeue", "junk", "not-a-message"],
                                    zk_url))
    assert "not a message celery_zk wrote" in err and "celery zk tree --data" in err
    assert zk_client.exists(LAYOUT.dead("junk") + "/not-a-message")   # nothing lost


def test_tree_exports_acls_and_data_only_when_asked_and_never_a_password(
        zookeeper_server: Any, zk_chroot: str) -> None:
    url = f"zk://alice:{SECRET}@{zookeeper_server.hosts}{zk_chroot}/app"
    with Connection(url) as conn:
        publish(conn, queue_of("t"), [{"secret_word": "hello"}])
    plain = celery_cli(["zk", "tree", "queues/t"], url)
    assert plain.returncode == 0, plain.stderr
    tree = json.loads(plain.stdout)
    assert tree["path"].endswith("/app/queues/t")
    assert {c["path"].rsplit("/", 1)[1] for c in tree["children"]} >= {"unowned", "owned"}
    acl = tree["acl"][0]
    assert acl == {"scheme": "digest", "id": "alice:<password hash hidden>",
                   "perms": "rwcda"}
    assert "hello" not in plain.stdout and '"data"' not in plain.stdout
    with_data = celery_cli(["zk", "tree", "queues/t", "--data"], url)
    assert with_data.returncode == 0, with_data.stderr
    # The message's body, stored apart from its (empty) name.
    messages = [node for node in _walk(json.loads(with_data.stdout))
                if "/bodies/p" in node["path"] and node.get("data")]
    [message] = messages
    assert json.loads(message["data"])["body"]   # the stored kombu message
    assert SECRET not in with_data.stdout + plain.stdout + with_data.stderr
    err = one_line_error(celery_cli(["zk", "tree", "queues/none"], url))
    assert "no node" in err


def test_the_exporter_serves_celery_exporter_compatible_metrics(
        zk_url: str, start_worker: Callable[..., Worker]) -> None:
    with Connection(zk_url) as conn:
        publish(conn, queue_of("metrics"), [{"n": i} for i in range(7)])
    start_worker(zk_url, queues="busy", pool="threads", concurrency=1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "CELERY_ZK_TEST_BROKER": zk_url,
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "proj.app", "zk",
                             "exporter", "--port", str(port), "--addr", "127.0.0.1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        body = ""

        def scraped() -> bool:
            nonlocal body
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                            timeout=5) as reply:
                    body = reply.read().decode()
                return 'queue_name="busy"' in body
            except OSError:
                return False

        wait_until(scraped, 30, 0.3, message=f"no metrics; exporter: {proc.poll()}")
        assert 'celery_queue_length{queue_name="metrics"} 7.0' in body
        assert 'celery_active_consumer_count{queue_name="busy"} 1.0' in body
        assert 'celery_active_consumer_count{queue_name="metrics"} 0.0' in body
        assert 'celery_zk_queue_waiting{priority="0",queue_name="metrics"} 7.0' in body
        assert "celery_zk_up 1.0" in body and "celery_zk_server_up{" in body
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode in (0, 1, -15)


def _walk(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node] + [n for child in node.get("children", []) for n in _walk(child)]


def test_status_watch_refreshes_until_stopped(zk_url: str) -> None:
    with Connection(zk_url) as conn:
        publish(conn, queue_of("watched"), [{"n": 1}])
    env = {**os.environ, "CELERY_ZK_TEST_BROKER": zk_url,
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "proj.app", "zk", "status",
                             "--json", "--watch", "0.3"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    # Wait for three reports, however slowly this machine starts Celery, then
    # interrupt it mid-stream: Ctrl-C must never leave a line cut in half.
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while len(lines) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=15)
        reader.join(timeout=15)
        err = proc.stderr.read()
    out = "".join(lines)
    reports = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(reports) >= 3, (out[-500:], err)
    assert all(r["queues"][0]["waiting"] == 1 for r in reports)
    assert proc.returncode == 0, err
