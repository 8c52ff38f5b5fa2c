"""The nemesis itself: applies each planned fault to the cluster, then heals it.

Runs in the harness's main thread, one fault at a time (:mod:`nemesis.schedule`).
Each fault is recorded with the time it started and the time its heal began
(a partition lifted, a SIGCONT, a restart spawned), which is where the
recovery measurement starts (:mod:`nemesis.recovery`).
"""
from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from common import figures

from .cluster import Cluster
from .dispatcher import Lookup
from .schedule import Fault

log = partial(figures.log, tag="nemesis")


@dataclass
class Applied:
    """One fault as it happened."""

    kind: str
    rule: str           # the plan's target: a host, "leader" or "dispatcher"
    target: str         # the host it hit
    started: float      # time.time()
    healed: float = 0.0
    minority: list[str] = field(default_factory=list)
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Nemesis:
    def __init__(self, cluster: Cluster, lookup: Lookup, seed: int) -> None:
        self.cluster = cluster
        self.lookup = lookup
        self.rng = random.Random(seed ^ 0x5EED)   # fallbacks only: the plan is the seed's
        self.applied: list[Applied] = []
        self._heal: Callable[[], None] | None = None

    # -- targets --------------------------------------------------------------------
    def _resolve(self, fault: Fault) -> tuple[str, str]:
        """(host, note) for the fault's target rule, now."""
        cluster = self.cluster
        if fault.target == "dispatcher":
            holder, itself = cluster.dispatcher_holder(self.lookup)
            if holder is not None:
                return holder, ("holds the dispatcher role" if itself else
                                "next in line for the dispatcher role (the holder died)")
            return self.rng.choice(list(cluster.workers)), "no dispatcher found: random"
        if fault.target == "leader":
            leader = cluster.zk_leader()
            if leader is not None:
                return cluster.zk_hosts[leader], "was the leader"
            return self.rng.choice(cluster.zk_hosts), "no leader found: random"
        return fault.target, ""

    # -- faults ---------------------------------------------------------------------
    def _apply(self, fault: Fault, host: str) -> Callable[[], None]:
        """Start the fault on ``host``; return what heals it."""
        cluster, net = self.cluster, self.cluster.net
        kind = fault.kind
        if kind == "partition-zk":
            net.cut([host], [h for h in cluster.zk_hosts if h != host])
            return net.heal
        if kind == "partition-worker":
            net.cut([host], cluster.zk_hosts)
            return net.heal
        if kind == "partition-split":
            minority = set(fault.minority)
            net.cut(minority, [h for h in net.hosts if h not in minority])
            return net.heal
        if kind == "kill-zk":
            index = cluster.zk_hosts.index(host)
            cluster.ensemble.kill_member(index)
            member = cluster.ensemble.members[index]

            def restart() -> None:
                member.start(timeout=60)   # from its data dir: it rejoins as a follower
            return restart
        if kind == "pause-zk":
            pid = cluster.ensemble.members[cluster.zk_hosts.index(host)].pid
            if pid is None:
                return lambda: None
            os.killpg(pid, signal.SIGSTOP)
            return lambda: os.killpg(pid, signal.SIGCONT)
        worker = cluster.workers[host]
        if kind == "kill-worker":
            worker.kill()
            return worker.start
        if kind == "pause-worker":
            worker.pause()
            return worker.resume
        raise ValueError(f"unknown fault kind {kind!r}")

    def run(self, plan: list[Fault], started: float, until: float) -> list[Applied]:
        """Apply ``plan`` (times relative to ``started``, a time.monotonic()); stop
        planning new faults after ``until``."""
        for fault in plan:
            wait = started + fault.at - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if time.monotonic() + fault.duration > until:
                break
            host, note = self._resolve(fault)
            record = Applied(fault.kind, fault.target, host, time.time(),
                             minority=list(fault.minority), note=note)
            self.applied.append(record)
            detail = f" minority {sorted(fault.minority)}" if fault.minority else ""
            log(f"{fault.kind} {host}{detail} ({note or fault.target}) for {fault.duration:.1f}s")
            self._heal = self._apply(fault, host)
            time.sleep(fault.duration)
            self.heal()
        return self.applied

    def heal(self) -> None:
        """Lift the fault in force, if any (also from the harness's finally)."""
        heal, self._heal = self._heal, None
        if heal is not None:
            if self.applied:
                self.applied[-1].healed = time.time()
            heal()
