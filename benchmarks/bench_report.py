"""bench.py's report: the machine, the results table and the targets, PASS or MISS.

The targets are ratios the issues set (zk against Redis or kombu's
``zookeeper://``); under each latency target a ``floor:`` line divides the
floor (e) by the same denominator, which says whether the target can be met
on this machine at all.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
from typing import Any

import celery
import kazoo
import kombu
from bench_measure import BROKERS, FLOOR, UNCONFIRMED
from common import RedisServer, fmt, table

from celery_zk.server import ZooKeeperServer, four_letter_word

TARGETS = [
    # key, numerator, denominator, op, bound, description
    ("latency_p50", "zk", "redis", "<=", 2.0, "round-trip p50: zk / redis"),
    ("drain_rate", "zk", "redis", ">=", 1.0, "drain rate: zk / redis"),
    ("publish_rate", "zk", "kombu-zk", ">=", 1.0, "publish rate: zk / kombu-zk"),
    ("result_p50", "zk", "redis", "<=", 2.0, "result round-trip p50: zk / redis"),
]
#: Targets a floor (e) bounds from below: the floor's ratio to the same denominator.
FLOOR_OF = {"latency_p50": "handoff", "result_p50": "result-handoff"}


def verdict(value: float, op: str, bound: float) -> str:
    ok = value <= bound if op == "<=" else value >= bound
    return "PASS" if ok else "MISS"


def machine(args: argparse.Namespace, zk: ZooKeeperServer, redis: RedisServer
            ) -> dict[str, Any]:
    """The machine and the versions the figures were taken with."""
    srvr = four_letter_word("127.0.0.1", zk.port or 0, "srvr")
    zk_version = next((line.split(":", 1)[1].strip().split(",")[0].split("-")[0]
                       for line in srvr.splitlines() if line.startswith("Zookeeper version")),
                      "unknown")
    info: dict[str, Any] = {
        "nproc": os.cpu_count(), "python": platform.python_version(),
        "zookeeper": zk_version, "zk forceSync": args.zk_force_sync,
        "redis": redis.version(), "celery": celery.__version__,
        "kombu": kombu.__version__, "kazoo": kazoo.__version__,
        "platform": platform.platform()}
    if args.zk_jvm_flag:
        info["zk extra jvm flags"] = " ".join(args.zk_jvm_flag)
    return info


def filesystem_of(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True,
                             check=True).stdout.splitlines()[-1].split()
        return f"{out[1]} {out[0]}"
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown filesystem"


def render(results: dict[str, dict[str, Any]], info: dict[str, Any],
           notes: list[str]) -> tuple[str, list[dict[str, Any]]]:
    cols: list[tuple[str, str]] = [
            ("broker", ""), ("rt p50 ms", "latency_p50"), ("rt p99 ms", "latency_p99"),
            ("rt n", "latency_samples"), ("drain/s", "drain_rate"),
            ("drain/s incl start", "drain_rate_incl_startup"), ("backlog", "drain_tasks"),
            ("publish/s", "publish_rate"), ("result p50 ms", "result_p50"),
            ("result p99 ms", "result_p99")]
    rows = [[head for head, _ in cols]]
    order = [*BROKERS, UNCONFIRMED, FLOOR]
    for name, res in sorted(results.items(), key=lambda item: order.index(item[0])):
        rows.append([name] + [fmt(res.get(key)) for _, key in cols[1:]])
    out = ["", "Machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), ""] + table(rows)
    out += ["", "Targets:"]
    verdicts = []
    for key, num, den, op, bound, what in TARGETS:
        a, b = results.get(num, {}).get(key), results.get(den, {}).get(key)
        if a is None or b is None:
            out.append(f"  {what:38s} not measured")
            continue
        ratio = a / b
        v = verdict(ratio, op, bound)
        verdicts.append({"target": what, "ratio": ratio, "bound": f"{op} {bound}",
                         "verdict": v})
        out.append(f"  {what:38s} {a:10,.1f} / {b:10,.1f} = {ratio:6.2f}  "
                   f"(target {op} {bound})  {v}")
        floor = results.get(FLOOR, {}).get(key)
        if key in FLOOR_OF and floor is not None:
            floor_ratio = floor / b
            verdicts[-1]["floor_ratio"] = floor_ratio
            reach = ("below the target" if verdict(floor_ratio, op, bound) == "PASS"
                     else "already above the target: unreachable on this machine")
            out.append(f"    floor: bare ZooKeeper requests {floor:10,.1f} / {b:10,.1f} = "
                       f"{floor_ratio:6.2f}  ({reach})")
    if notes:
        out += ["", "Notes:"] + [f"  - {n}" for n in notes]
    return "\n".join(out), verdicts
