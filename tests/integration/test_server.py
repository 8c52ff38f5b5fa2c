"""The launcher, the ensemble and ``celery zk server`` against real ZooKeeper."""
from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from celery_zk.exceptions import PortInUse, ServerStartError
from celery_zk.server import ZooKeeperServer, four_letter_word, free_ports
from celery_zk.server.ensemble import ZooKeeperEnsemble

CELERY = [sys.executable, "-m", "celery"]


def java_processes(marker: str) -> list[int]:
    """Pids whose command line mentions ``marker`` (e.g. a data dir)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if "java" in cmdline and marker in cmdline:
            pids.append(int(entry))
    return pids


def connect(hosts: str) -> KazooClient:
    client = KazooClient(hosts=hosts)
    client.start(timeout=15)
    return client


def test_server_answers_ruok_and_stops_cleanly(tmp_path: Path) -> None:
    data_dir = str(tmp_path / "zk")
    with ZooKeeperServer(data_dir=data_dir) as zk:
        assert zk.running and zk.ruok()
        assert four_letter_word(zk.host, zk.client_port, "ruok") == "imok"
        assert zk.url == f"zk://127.0.0.1:{zk.port}"
        assert java_processes(data_dir) == [zk.pid]
        assert "binding to port" in zk.read_log()
    assert not zk.running and not zk.ruok()
    assert java_processes(data_dir) == []
    assert os.path.isdir(data_dir)  # a data dir we chose is kept


def test_restart_keeps_data(tmp_path: Path) -> None:
    with ZooKeeperServer(data_dir=str(tmp_path / "zk")) as zk:
        client = connect(zk.hosts)
        client.create("/kept", b"across restart")
        client.stop()
        client.close()
        old_pid, port = zk.pid, zk.port
        zk.restart()
        assert zk.pid != old_pid and zk.port == port
        client = connect(zk.hosts)
        try:
            assert client.get("/kept")[0] == b"across restart"
        finally:
            client.stop()
            client.close()


def test_busy_port_is_refused(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        zk = ZooKeeperServer(port=port, data_dir=str(tmp_path / "zk"))
        with pytest.raises(PortInUse, match=f"Port {port} .*--port"):
            zk.start()
        assert not zk.running


def test_start_failure_reports_log_tail(tmp_path: Path) -> None:
    zk = ZooKeeperServer(data_dir=str(tmp_path / "zk"), extra_config={"tickTime": "soon"})
    with pytest.raises(ServerStartError, match="exited with code") as err:
        zk.start()
    assert "NumberFormatException" in str(err.value) or "soon" in str(err.value)
    assert java_processes(str(tmp_path / "zk")) == []


# -- celery zk server ----------------------------------------------------------
def read_until(proc: subprocess.Popen[bytes], text: str, timeout: float = 60) -> str:
    """Stdout up to ``text`` (fails on exit or timeout). Raw reads: a buffered
    reader would hide already-read lines from the selector."""
    assert proc.stdout is not None
    seen = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while text.encode() not in seen:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {text!r} within {timeout}s; output so far:\n{seen!r}"
            if sel.select(remaining):
                chunk = os.read(proc.stdout.fileno(), 4096)
                assert chunk, f"CLI exited ({proc.wait()}) before {text!r}:\n{seen!r}"
                seen += chunk
    return seen.decode()


def stop_cli(proc: subprocess.Popen[bytes], marker: str) -> None:
    """After a failed test: stop the CLI the way a user would, then sweep its java."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid in java_processes(marker):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_cli_runs_until_signalled(tmp_path: Path, signum: int) -> None:
    data_dir = str(tmp_path / "data")
    port = free_ports()[0]
    proc = subprocess.Popen([*CELERY, "zk", "server", "--port", str(port),
                             "--data-dir", data_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out = read_until(proc, "broker_url")
        assert f"ZooKeeper is ready: zk://127.0.0.1:{port}" in out
        assert f"broker_url = 'zk://127.0.0.1:{port}/myapp'" in out
        assert four_letter_word("127.0.0.1", port, "ruok") == "imok"
        assert len(java_processes(data_dir)) == 1
        proc.send_signal(signum)
        out = proc.communicate(timeout=30)[0].decode()
    finally:
        stop_cli(proc, data_dir)
    assert proc.returncode == 0, out
    assert "ZooKeeper stopped." in out
    assert java_processes(data_dir) == []
    assert os.path.isdir(data_dir)


def test_cli_busy_port(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run([*CELERY, "zk", "server", "--port", str(port),
                                 "--data-dir", str(tmp_path / "d")],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert f"Port {port}" in result.stderr
    assert "Traceback" not in result.stderr
    assert java_processes(str(tmp_path / "d")) == []


def test_cli_without_zookeeper(tmp_path: Path) -> None:
    # An explicit ZOOKEEPER_HOME is authoritative: an empty one means "not installed".
    env = {**os.environ, "ZOOKEEPER_HOME": str(tmp_path)}
    result = subprocess.run([*CELERY, "zk", "server", "--port", str(free_ports()[0])],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode != 0
    assert "sudo apt-get install zookeeper" in result.stderr
    assert "brew install zookeeper" in result.stderr
    assert "Traceback" not in result.stderr


# -- ensemble --------------------------------------------------------------------
@pytest.mark.slow
def test_ensemble_survives_leader_loss(tmp_path: Path) -> None:
    with ZooKeeperEnsemble(data_dir=str(tmp_path)) as ensemble:
        modes = [ensemble.mode(i) for i in range(3)]
        assert sorted(modes) == ["follower", "follower", "leader"]
        assert ensemble.hosts.count(",") == 2
        leader = ensemble.leader_index()
        client = connect(ensemble.hosts)
        try:
            client.create("/before", b"1")
            ensemble.stop_member(leader)
            assert ensemble.mode(leader) == "down"
            new_leader = ensemble.wait_for_quorum(timeout=60)
            assert new_leader != leader
            client.create("/after", b"2", makepath=True)  # kazoo retries onto a live member
            assert client.get("/before")[0] == b"1"

            ensemble.start_member(leader)
            assert ensemble.mode(leader) == "follower"
            assert ensemble.leader_index() == new_leader
        finally:
            client.stop()
            client.close()
    assert java_processes(str(tmp_path)) == []


@pytest.mark.slow
def test_ensemble_members_on_their_own_addresses_survive_a_kill(tmp_path: Path) -> None:
    """Members on 127.0.0.1-3 (one port triple for all, as on separate machines),
    each started through a command prefix; a SIGKILLed leader comes back from its data."""
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    prefixes = [["env", f"CELERY_ZK_MEMBER={i}"] for i in range(3)]
    with ZooKeeperEnsemble(data_dir=str(tmp_path), hosts=hosts,
                           command_prefixes=prefixes) as ensemble:
        assert [m.host for m in ensemble.members] == hosts
        for i, member in enumerate(ensemble.members):
            # The prefix execs java: the pid the launcher holds is java's.
            with open(f"/proc/{member.pid}/environ", "rb") as fh:
                assert f"CELERY_ZK_MEMBER={i}".encode() in fh.read().split(b"\0")
            assert f"{hosts[i]}:{member.port}" in ensemble.hosts
        client = connect(ensemble.hosts)
        try:
            client.create("/before", b"1")
            leader = ensemble.leader_index()
            ensemble.kill_member(leader)
            assert ensemble.mode(leader) == "down"
            assert ensemble.wait_for_quorum(timeout=60) != leader
            client.create("/after", b"2")
            ensemble.start_member(leader)
            assert ensemble.mode(leader) == "follower"
            assert client.get("/before")[0] == b"1"
        finally:
            client.stop()
            client.close()
    assert java_processes(str(tmp_path)) == []
