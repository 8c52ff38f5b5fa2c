"""The machine's CPU for ``workers.py``: busy time machine-wide, and whose it was.

CPU per delivered task is taken machine-wide (``/proc/stat``), so that the
broker's server, the workers and kernel work on their behalf all count, and
a broker that saves client CPU by spending server CPU gains nothing. That
also counts whatever else runs on the machine: before a measurement
:func:`quiet_check` looks for it, and :class:`CpuWindow` says afterwards how
much of the busy time no process of the run accounts for.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable

from .figures import log

QUIET = 0.5          # cores busy (the load average's unit) above which a measurement warns
FOREIGN = 0.10       # share of the busy time not ours above which a measurement warns
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_fields() -> list[int]:
    """user nice system idle iowait irq softirq steal, in jiffies."""
    with open("/proc/stat", encoding="ascii") as fh:
        return [int(v) for v in fh.readline().split()[1:9]]


def _busy(fields: list[int]) -> int:
    """Busy time of every core: user+nice+system+irq+softirq+steal (guest is in user)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq + steal


def busy_jiffies() -> int:
    return _busy(cpu_fields())


def busy_cores() -> float:
    before, began = busy_jiffies(), time.monotonic()
    time.sleep(1.0)
    return (busy_jiffies() - before) / CLK_TCK / (time.monotonic() - began)


def quiet_check(label: str, settle: float) -> dict[str, float]:
    """Busy cores over the last second, waiting up to ``settle`` s for quiet. (The
    1-minute load average still carries the previous measurement for minutes, so it
    is recorded, not waited on.)"""
    deadline = time.monotonic() + settle
    busy = busy_cores()
    while busy > QUIET and time.monotonic() < deadline:
        busy = busy_cores()
    load = os.getloadavg()[0]
    if busy > QUIET:
        log(f"WARNING: {label}: {busy:.2f} cores busy just before the measurement "
            f"(load average {load:.2f}): something else is running, figures are suspect")
    return {"busy_cores_before": round(busy, 3), "loadavg1_before": round(load, 2)}


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def run_pids(groups: Iterable[int], pids: Iterable[int]) -> list[int]:
    """``pids`` and every process in the process groups ``groups`` (a worker's pool
    children, a server's helpers): the run's processes."""
    groups, found = set(groups), set(pids)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) and int(fields[2]) in groups:
            found.add(int(entry))
    return sorted(found)


def process_jiffies(pids: Iterable[int]) -> int:
    """utime + stime of ``pids`` (all their threads), those still alive, plus cutime +
    cstime: their children already reaped (a worker stopped within the window)."""
    return sum(int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
               for f in map(_stat, pids) if f)


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU of ``pids`` so far, what they reaped included (:func:`process_jiffies`)."""
    return process_jiffies(pids) / CLK_TCK


class CpuWindow:
    """Busy jiffies between :meth:`start` and :meth:`stop`, machine-wide and of the
    run's processes, each of its parts (name -> pids, e.g. the server and the
    workers) apart; the run's are all its parts' together."""

    def __init__(self, parts: dict[str, list[int]]) -> None:
        self.parts = parts
        self.machine = self.ours = self.processes = 0
        self.by_part: dict[str, int] = {}

    def start(self) -> None:
        fields = cpu_fields()
        self.by_part = {name: -process_jiffies(pids) for name, pids in self.parts.items()}
        self.machine, self.processes = -_busy(fields), -sum(fields[:3])

    def stop(self) -> None:
        fields = cpu_fields()
        for name, pids in self.parts.items():
            self.by_part[name] += process_jiffies(pids)
        self.ours = sum(self.by_part.values())
        self.machine += _busy(fields)
        self.processes += sum(fields[:3])

    def report(self, label: str) -> dict[str, float]:
        """Busy time of processes that are not the run's (user+nice+system minus ours;
        interrupts are nobody's) as a share of the machine's."""
        foreign = max(0, self.processes - self.ours) / max(1, self.machine)
        if foreign > FOREIGN:
            log(f"WARNING: {label}: {foreign:.0%} of the busy time was other processes': "
                "something else ran during the measurement")
        return {"busy_jiffies": self.machine, "run_jiffies": self.ours,
                "others_share": round(foreign, 3)}
