"""The nemesis's plan: which fault, on what, when and for how long, from a seed.

A plan is a list of :class:`Fault`, one at a time: each starts after a quiet
gap (so the recovery from the previous heal can be measured), lasts its
duration, and is healed. Targets that only exist at run time are named by a
rule, resolved when the fault starts (:mod:`nemesis.faults`):

* ``leader``: the ZooKeeper member that leads at that moment (``srvr``);
* ``dispatcher``: the worker that holds the queue's dispatcher role
  (:mod:`nemesis.dispatcher`), the favoured target;
* otherwise a host name chosen here, from the seed.

The short mode runs every kind once, in a seeded order, with short
durations; the long mode draws kinds by weight until the time is used up.
Pauses and the long partitions outlast the session timeout, so sessions
expire and owners are lost; the short partitions do not, so connections
come back to sessions that are still alive.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Kind(NamedTuple):
    weight: float                 # how often the long mode draws it
    long: tuple[float, float]     # seconds it lasts, long mode
    short: tuple[float, float]    # seconds it lasts, short mode


KINDS: dict[str, Kind] = {k: Kind(*v) for k, v in {
    # one member cut off from the other two (clients still reach it; it cannot serve)
    "partition-zk": (1.0, (5, 30), (6, 10)),
    # a worker host cut off from the whole ensemble
    "partition-worker": (1.5, (3, 30), (14, 16)),
    # one member and some workers on one side, the rest and the publisher on the other
    "partition-split": (1.0, (5, 30), (14, 16)),
    # SIGKILL of a member, restarted on its data after the downtime
    "kill-zk": (1.0, (1, 20), (4, 8)),
    # SIGKILL of a worker host (the process group: pool children too), then restarted
    "kill-worker": (1.5, (1, 15), (2, 5)),
    # SIGSTOP for longer than the session timeout, then SIGCONT
    "pause-worker": (1.0, (11, 25), (12, 14)),
    "pause-zk": (0.5, (11, 25), (12, 14)),
}.items()}
GAP_LONG = (10.0, 30.0)     # quiet seconds between a heal and the next fault
GAP_SHORT = (6.0, 8.0)
FAVOUR_DISPATCHER = 0.5     # share of worker faults aimed at the dispatcher's holder
FAVOUR_LEADER = 0.5         # share of member faults aimed at the ZooKeeper leader


@dataclass(frozen=True)
class Fault:
    at: float          # seconds after the nemesis starts
    kind: str
    target: str        # a host, "leader" or "dispatcher"
    duration: float
    #: partition-split: the hosts on the minority side (target is its member)
    minority: tuple[str, ...] = ()


def _target(rng: random.Random, kind: str, zk: Sequence[str], workers: Sequence[str]) -> str:
    if kind.endswith("-worker"):
        return "dispatcher" if rng.random() < FAVOUR_DISPATCHER else rng.choice(workers)
    return "leader" if rng.random() < FAVOUR_LEADER else rng.choice(zk)


def _fault(rng: random.Random, at: float, kind: str, short: bool, zk: Sequence[str],
           workers: Sequence[str]) -> Fault:
    low, high = KINDS[kind].short if short else KINDS[kind].long
    duration = round(rng.uniform(low, high), 1)
    if kind == "partition-split":
        # The minority: one member (it loses its quorum) and at least one worker;
        # the majority keeps two members, the publisher and the other workers.
        member = rng.choice(zk)
        count = rng.randint(1, max(1, len(workers) - 1))
        return Fault(at, kind, member, duration,
                     minority=(member, *sorted(rng.sample(list(workers), count))))
    return Fault(at, kind, _target(rng, kind, zk, workers), duration)


def plan(seed: int, seconds: float, zk: Sequence[str], workers: Sequence[str],
         short: bool = False) -> list[Fault]:
    """The faults of a run of ``seconds`` (each one healed before the time is up)."""
    rng = random.Random(seed)
    gap = GAP_SHORT if short else GAP_LONG
    faults: list[Fault] = []
    at = 0.0
    kinds = list(KINDS)
    if short:
        rng.shuffle(kinds)
    while True:
        if short:
            if not kinds:
                break
            kind = kinds.pop()
        else:
            kind = rng.choices(list(KINDS), weights=[k.weight for k in KINDS.values()])[0]
        at += rng.uniform(*gap)
        fault = _fault(rng, round(at, 1), kind, short, zk, workers)
        if fault.at + fault.duration > seconds:
            break
        faults.append(fault)
        at = fault.at + fault.duration
    return faults


def short_seconds(zk: Sequence[str], workers: Sequence[str], seed: int) -> float:
    """How long the short mode's plan takes (every kind once)."""
    faults = plan(seed, float("inf"), zk, workers, short=True)
    return faults[-1].at + faults[-1].duration
