"""Measuring a run: CPU from ``/proc``, ZooKeeper's zxid, exactly-once checks,
and idle latency."""
from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import asdict
from typing import Any

from common import log, percentile  # benchmarks/common.py (the script puts it on sys.path)
from kazoo.client import KazooClient

from celery_zk.server import ZooKeeperServer, four_letter_word

from . import wire
from .config import (
    BASELINE,
    BATCH_END,
    CLK_TCK,
    Counts,
    Paths,
    Run,
    consumer_ids,
    make_body,
    make_client,
)
from .processes import Cluster, publish


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK   # utime + stime


def machine_busy() -> float:
    """Busy CPU seconds of the whole machine so far (every core)."""
    with open("/proc/stat", encoding="ascii") as fh:
        fields = [int(x) for x in fh.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def zxid(zk: ZooKeeperServer) -> int:
    for line in four_letter_word(zk.host, zk.client_port, "srvr").splitlines():
        if line.startswith("Zxid:"):
            return int(line.split()[1], 16) & 0xFFFFFFFF   # counter within the epoch
    raise RuntimeError("srvr shows no Zxid")


def prepare_tree(client: KazooClient, run: Run) -> None:
    paths = Paths(run.root)
    if client.exists(run.root):
        client.delete(run.root, recursive=True)
    for path in (paths.unowned, paths.consumers, paths.offers):
        client.ensure_path(path)
    for cid in consumer_ids(run.k):
        client.ensure_path(paths.inbox(cid))


def leftovers(client: KazooClient, run: Run) -> list[str]:
    """Nodes a complete run must not leave: messages, bodies, inbox entries."""
    paths = Paths(run.root)
    left = []
    for bucket in client.get_children(paths.unowned):
        left += [f"{bucket}/{n}" for n in client.get_children(f"{paths.unowned}/{bucket}")]
    for child in client.get_children(paths.owned):
        left += [f"owned/{child}/{n}" for n in client.get_children(f"{paths.owned}/{child}")]
    return left


def drain(zk: ZooKeeperServer, run: Run) -> dict[str, Any]:
    """One run: preloaded (or steadily published) messages, all acked once. Figures."""
    admin = make_client(zk.hosts, BASELINE)
    try:
        prepare_tree(admin, run)
        if run.mode == "preload":
            started = time.monotonic()
            publish(admin, run, range(run.messages))
            log(f"preloaded {run.messages:,} in {time.monotonic() - started:.1f}s", "model")
        cluster = Cluster(zk, run)
        try:
            cluster.start()
            pids = cluster.pids()
            cpu0 = {pid: cpu_seconds(pid) for pid in pids}
            zk0, zxid0 = cpu_seconds(zk.pid or 0), zxid(zk)
            busy0 = machine_busy()
            t0 = time.monotonic()
            cluster.sync.go.set()
            _wait_done(cluster, run)
            elapsed_seen = time.monotonic() - t0
            cpu1 = {pid: cpu_seconds(pid) for pid in pids}
            zk1, zxid1 = cpu_seconds(zk.pid or 0), zxid(zk)
            busy = machine_busy() - busy0
        finally:
            results = cluster.stop()
        figures = _figures(run, results, t0, elapsed_seen, cpu0, cpu1, zk1 - zk0,
                           zxid1 - zxid0, cluster)
        # Anything else that ran meanwhile (this process's polling, other users of
        # the machine): large values mean the figures were disturbed.
        other = busy - sum(cpu1[p] - cpu0[p] for p in pids) - (zk1 - zk0)
        figures["cpu_other_per_1000"] = round(other / run.messages * 1000, 3)
        figures["machine_busy_share"] = round(busy / (elapsed_seen * (os.cpu_count() or 1)), 3)
        left = leftovers(admin, run)
        if left:
            figures["errors"].append(f"{len(left)} nodes left, e.g. {left[:3]}")
        admin.delete(run.root, recursive=True)
        return figures
    finally:
        admin.stop()
        admin.close()


def _wait_done(cluster: Cluster, run: Run) -> None:
    progress = cluster.sync.progress
    last, last_change = -1, time.monotonic()
    while True:
        done = sum(progress)
        if done >= run.messages:
            return
        now = time.monotonic()
        if done != last:
            last, last_change = done, now
        elif now - last_change > 20:
            raise RuntimeError(f"no progress for 20 s at {done:,} of {run.messages:,} acked")
        if any(not proc.is_alive() for _, proc in cluster.procs):
            raise RuntimeError("a process died; its error is above")
        time.sleep(0.01)


def _figures(run: Run, results: list[tuple[str, dict[str, Any]]], t0: float,
             elapsed_seen: float, cpu0: dict[int, float], cpu1: dict[int, float],
             zk_cpu: float, zxids: int, cluster: Cluster) -> dict[str, Any]:
    totals = Counts()
    dispatch = Counts()   # the dispatcher's share of totals
    acked: list[int] = []
    errors: list[str] = []
    last_ack = 0.0
    latencies: list[float] = []
    for role, data in results:
        errors += data.get("errors", [])
        counted = [data["counts"]] if "counts" in data else []
        if role == "consumer":
            acked += data["acked"]
            last_ack = max(last_ack, data["last_ack"])
            latencies += data["latencies"]
            if data.get("dispatcher"):
                counted.append(data["dispatcher"])
                _add(dispatch, data["dispatcher"])
        elif role == "dispatcher":
            _add(dispatch, data["counts"])
        for counts in counted:
            _add(totals, counts)
    n = run.messages
    if len(results) < len(cluster.procs):
        errors.append(f"only {len(results)} of {len(cluster.procs)} processes reported")
    if len(acked) != n or len(set(acked)) != n or set(acked) != set(range(n)):
        dup = len(acked) - len(set(acked))
        errors.append(f"acked {len(acked):,} (duplicates {dup:,}, missing "
                      f"{len(set(range(n)) - set(acked)):,}) of {n:,}")
    elapsed = (last_ack - t0) if last_ack > t0 else elapsed_seen
    python_cpu = sum(cpu1[pid] - cpu0[pid] for pid in cpu0)
    role_cpu: dict[str, float] = {}
    for (role, proc) in cluster.procs:
        role_cpu[role] = role_cpu.get(role, 0.0) + cpu1[proc.pid] - cpu0[proc.pid]
    figures: dict[str, Any] = {
        "variant": run.variant, "k": run.k, "mode": run.mode, "messages": n,
        "rate": run.rate, "dispatcher": run.dispatcher if run.dispatched else None,
        "tuning": asdict(run.tuning),
        "seconds": round(elapsed, 3),
        "msgs_per_s": round(n / elapsed, 1),
        "cpu_python_per_1000": round(python_cpu / n * 1000, 3),
        "cpu_zk_per_1000": round(zk_cpu / n * 1000, 3),
        "cpu_by_role_per_1000": {r: round(c / n * 1000, 3) for r, c in role_cpu.items()},
        "txn_per_msg": round(totals.writes / n, 3),
        "failed_per_msg": round(totals.failed / n, 4),
        "zxid_per_msg": round(zxids / n, 3),
        "reads_per_msg": round(totals.reads / n, 3),
        "gone_reads_per_msg": round(totals.gone_reads / n, 3),
        "events_per_msg": round(totals.events / n, 3),
        "moves_per_multi": round(dispatch.moved / dispatch.writes, 2) if dispatch.writes else None,
        "acks_per_multi": round(n / totals.ack_multis, 2) if totals.ack_multis else None,
        "errors": errors,
    }
    if latencies:
        figures["latency_ms"] = {"p50": round(percentile(latencies, 50), 2),
                                 "p99": round(percentile(latencies, 99), 2)}
    return figures


def _add(totals: Counts, counts: dict[str, int]) -> None:
    for key, value in counts.items():
        setattr(totals, key, getattr(totals, key) + value)


def idle_latency(zk: ZooKeeperServer, run: Run, samples: int, seed: int = 1) -> dict[str, Any]:
    """From a publisher's create returning to a consumer holding the body, idle consumers.

    ``latency-dispatch``: published into ``unowned/`` as usual, moved by the
    dispatcher. ``latency-direct``: written straight into the inbox of a
    consumer that left an offer, in one multi that deletes the offer.
    """
    admin = make_client(zk.hosts, run.tuning)
    paths = Paths(run.root)
    pauses = random.Random(seed)
    values: list[float] = []
    direct = run.mode == "latency-direct"
    failed = 0
    try:
        prepare_tree(admin, run)
        admin.ensure_path(paths.bucket(0))
        cluster = Cluster(zk, run, latency=True)
        offers: list[str] = []
        offers_changed = threading.Event()
        offers_changed.set()

        def on_offers(_event: Any) -> None:
            offers_changed.set()
        try:
            cluster.start()
            cluster.sync.go.set()
            time.sleep(0.3)   # the dispatcher lists, consumers offer
            for index in range(samples + 5):
                time.sleep(pauses.uniform(0.020, 0.050))
                if direct:
                    deadline = time.monotonic() + 10
                    while True:
                        if time.monotonic() > deadline:
                            raise RuntimeError("no consumer left an offer within 10 s")
                        if offers_changed.is_set() or not offers:
                            offers_changed.clear()
                            offers = admin.get_children(paths.offers, watch=on_offers)
                        if offers:
                            break
                        offers_changed.wait(1.0)
                    cid = offers.pop(pauses.randrange(len(offers)))
                    txn = admin.transaction()
                    # One multi: the offer is taken by exactly one publisher.
                    txn.delete(f"{paths.offers}/{cid}")
                    txn.create(f"{paths.inbox(cid)}/h-{index:010d}{BATCH_END}",
                               make_body(index, run.size))
                    if wire.multi_failure(txn.commit()) is not None:
                        failed += 1
                        continue
                    published = time.monotonic()
                else:
                    publish(admin, run, range(index, index + 1))
                    published = time.monotonic()
                got, held = cluster.sync.holds.get(timeout=10)
                if got != index:
                    raise RuntimeError(f"expected message {index}, a consumer held {got}")
                if index >= 5:
                    values.append((held - published) * 1000)
        finally:
            cluster.stop()
        admin.delete(run.root, recursive=True)
    finally:
        admin.stop()
        admin.close()
    return {"variant": run.variant, "mode": run.mode, "k": run.k, "tuning": asdict(run.tuning),
            "samples": len(values), "p50_ms": round(percentile(values, 50), 2),
            "p99_ms": round(percentile(values, 99), 2), "failed_offers": failed}
