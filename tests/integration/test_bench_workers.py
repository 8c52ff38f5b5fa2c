"""benchmarks/workers.py end to end: a quick run on zk alone writes sane figures.

Only the shape of the results is checked, never a timing: the figures depend
on the machine.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "workers.py"
PAIR = ROOT / "benchmarks" / "pair.py"


def run_script(script: Path, cwd: Path, *args: str, timeout: float = 280
               ) -> subprocess.CompletedProcess[str]:
    """``script`` from another directory, the checkout by PYTHONPATH: as when
    comparing commits."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def check_drain(entry: dict, tasks: int, processes: int | None = None) -> None:
    assert entry["tasks"] == entry["distinct"] == tasks   # every task ran
    assert entry["executions"] >= tasks
    assert entry["processes"] >= 1 if processes is None else entry["processes"] == processes
    assert entry["rate"] > 0 and entry["elapsed"] > 0
    assert entry["cpu_ms_per_task"] >= 0 and entry["busy_cores"] >= 0
    assert 0 <= entry["others_share"] <= 1
    assert entry["attempt"] == 1 and entry["discarded"] == []


@pytest.mark.slow
def test_quick_run_on_zk_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "workers.json"
    run = run_script(SCRIPT, tmp_path, "--quick", "--brokers", "zk", "--ks", "1",
                     "--settle", "0", "--retries", "0", "--json", str(out))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "tasks/s" in run.stdout

    data = json.loads(out.read_text())
    assert data["machine"]["celery_zk"]["path"] == str(ROOT)
    zk = data["results"]["zk"]
    assert list(zk["scaling"]) == ["1"]
    k1 = zk["scaling"]["1"]
    check_drain(k1, 600, processes=1)
    txns = k1["server_txns"]
    assert txns["transactions"] > 0
    assert txns["failed"] == txns["failed_multis"] + txns["failed_requests"]
    assert sum(txns["errors"].values()) == txns["failed"]
    assert k1["failed_per_message"] == txns["failed"] / 600

    check_drain(zk["single"]["threads -c 4"], 300, processes=1)
    check_drain(zk["single"]["prefork -c 4"], 300)   # run by the pool's children

    latency = zk["latency"]
    for state in ("idle", "loaded"):
        assert 0 <= latency[f"machine {state}"]["others_share"] <= 1
    for shape in ("oneway idle", "oneway loaded", "get idle", "get loaded"):
        assert 0 < latency[shape]["p50"] <= latency[shape]["p99"]
        assert latency[shape]["n"] == 20
    for state in ("idle", "loaded"):   # how long the publishing call took
        oneway = latency[f"oneway {state}"]
        assert 0 < oneway["publish_p50"] <= oneway["publish_p99"]
    # Each drain's CPU split by part: the workers spent some, and no part more than all
    for drain in (k1, zk["single"]["threads -c 4"], zk["single"]["prefork -c 4"]):
        parts = drain["cpu_ms_per_task_by_part"]
        assert set(parts) == {"server", "workers", "bench"}
        assert parts["workers"] > 0
        # the machine's busy time counts every part (and the kernel's work besides)
        assert sum(parts.values()) <= drain["cpu_ms_per_task"] * 1.25 + 0.1


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_pair_drains_two_checkouts_at_once(tmp_path: Path, pool: str) -> None:
    """benchmarks/pair.py: one pair of the same checkout, both drains complete;
    a threads pool has no children to divide by (the worker's CPU is all)."""
    out = tmp_path / "pair.json"
    run = run_script(PAIR, tmp_path, "--a", str(ROOT), "--b", str(ROOT), "--pool", pool,
                     "-c", "2", "--tasks", "400", "--pairs", "1", "--zk-warm-up", "0",
                     "--json", str(out))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["tasks"] == 400 and len(data["pairs"]) == 1
    pair = data["pairs"][0]
    assert pair["window_s"] > 0
    for side in ("a", "b"):
        assert pair[side]["rate"] > 0 and pair[side]["parent_us"] > 0
        assert (pair[side]["children_us"] > 0) == (pool == "prefork")
    assert pair["b_over_a"] == pytest.approx(pair["b"]["rate"] / pair["a"]["rate"])
    assert pair["parent_b_over_a"] == pytest.approx(
        pair["b"]["parent_us"] / pair["a"]["parent_us"])
    assert "b ÷ a, parent CPU per task, over 1 pairs" in run.stdout
    relative = "b ÷ a, parent CPU ÷ children CPU, over 1 pairs"
    if pool == "prefork":
        assert pair["relative_b_over_a"] == pytest.approx(
            (pair["b"]["parent_us"] / pair["b"]["children_us"])
            / (pair["a"]["parent_us"] / pair["a"]["children_us"]))
        assert relative in run.stdout
    else:
        assert pair["relative_b_over_a"] is None and relative not in run.stdout


def test_pair_refuses_a_directory_without_celery_zk(tmp_path: Path) -> None:
    run = run_script(PAIR, tmp_path, "--a", str(tmp_path), "--b", str(ROOT), timeout=60)
    assert run.returncode == 2
    assert "holds no celery_zk/" in run.stderr


def test_txnlog_counts_failed_transactions(zookeeper_server: object, zk_client: object) -> None:
    """The server-side count reads what ZooKeeper logged: failed multis and requests."""
    from kazoo.client import KazooClient
    from kazoo.exceptions import NodeExistsError
    data_dir = getattr(zookeeper_server, "data_dir", None)
    if data_dir is None:
        pytest.skip("an external ZooKeeper: its transaction log is not here")
    sys.path.insert(0, str(ROOT / "benchmarks"))   # the benchmarks' import root
    try:
        from common import txnlog
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    client = zk_client
    assert isinstance(client, KazooClient)
    host, port = zookeeper_server.host, zookeeper_server.port  # type: ignore[attr-defined]
    before = txnlog.last_zxid(host, port)
    client.create("/a", b"")
    for _ in range(3):   # the second op fails: the whole multi does
        txn = client.transaction()
        txn.create("/b", b"")
        txn.delete("/missing")
        txn.commit()
    for _ in range(2):
        with pytest.raises(NodeExistsError):
            client.create("/a", b"")
    counts = txnlog.count(data_dir, before, txnlog.last_zxid(host, port))
    assert (counts.failed_multis, counts.failed_requests) == (3, 2)
    assert counts.errors == {"multi NoNode": 3, "request NodeExists": 2}
    assert counts.transactions == 6


@pytest.mark.slow
@pytest.mark.timeout(960)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="hosts apart are network namespaces: needs root and iproute2")
def test_quick_run_of_the_production_shape(tmp_path: Path) -> None:
    """zk3 (three members) and rabbitmq3 (a cluster of three, quorum queues), each
    member on a host of its own, and Celery alone: every figure, and nothing left."""
    out = tmp_path / "workers.json"
    run = run_script(SCRIPT, tmp_path, "--quick", "--brokers", "zk3,rabbitmq3,memory",
                     "--ks", "1", "--settle", "0", "--retries", "0", "--samples", "5",
                     "--json", str(out), timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert "a cluster of 3, quorum queues" in results["rabbitmq3"]["server"]
    for name in ("zk3", "rabbitmq3"):
        check_drain(results[name]["scaling"]["1"], 600, processes=1)
        check_drain(results[name]["single"]["threads -c 4"], 300, processes=1)
        for shape in ("oneway idle", "oneway loaded", "get idle", "get loaded"):
            assert 0 < results[name]["latency"][shape]["p50"]
    # All three members' processes count as the server, and every write is in the log
    k1 = results["zk3"]["scaling"]["1"]
    assert k1["cpu_ms_per_task_by_part"]["server"] > 0 and k1["server_txns"]["transactions"] > 0
    # Each message is read and acked through some member: requests, replies and events counted
    assert k1["requests_per_message"] > 0 and k1["packets_sent_per_message"] > 0
    memory = results["memory"]
    assert list(memory["scaling"]) == ["1"] and "latency" not in memory
    check_drain(memory["scaling"]["1"], 600, processes=1)
    check_drain(memory["single"]["prefork -c 4"], 300)
    assert "zk3 ÷ rabbitmq3" in run.stdout and "Issue 60 targets:" in run.stdout
    # Nothing of the hosts apart is left: no namespace, no member, no node
    assert "czkn-" not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                         text=True).stdout
    left = subprocess.run(["pgrep", "-af", "celery-zk-workers-|rabbit@10\\.231\\."],
                          capture_output=True, text=True)   # the run's work dir, a node
    assert left.stdout == ""


@pytest.mark.slow
def test_fleet_drains_with_every_consumer_counted(tmp_path: Path) -> None:
    """benchmarks/fleet.py, small: lean consumers in several processes drain one
    queue (the dispatcher's CPU found in exactly one of them), then two."""
    out = tmp_path / "fleet.json"
    run = run_script(ROOT / "benchmarks" / "fleet.py", tmp_path, "--brokers", "zk",
                     "--consumers", "3,8", "--per-process", "4", "--tasks", "400",
                     "--zk-warm-up", "0", "--json", str(out))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    entries = json.loads(out.read_text())["results"]["zk"]
    assert [(e["consumers"], e["processes"]) for e in entries] == [(3, 1), (8, 2)]
    for entry in entries:
        assert entry["rate"] > 0 and entry["dispatchers_seen"] == 1
        assert entry["dispatcher_cpu_ms_per_message"] > 0
        assert entry["txns_per_message"] > 0 and entry["requests_per_message"] > 0
    assert "N lean consumers" in run.stdout
    # Eight consumers on two queues: a dispatcher for each
    run = run_script(ROOT / "benchmarks" / "fleet.py", tmp_path, "--brokers", "zk",
                     "--consumers", "8", "--per-process", "4", "--tasks", "400",
                     "--queues", "2", "--zk-warm-up", "0", "--json", str(out))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    entry, = json.loads(out.read_text())["results"]["zk"]
    assert (entry["queues"], entry["dispatchers_seen"]) == (2, 2) and entry["rate"] > 0
