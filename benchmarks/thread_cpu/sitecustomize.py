"""Where a ``celery worker`` parent's CPU goes, thread by thread, per task.

Not imported by celery_zk: a benchmark puts this directory first on the
workers' ``PYTHONPATH`` and sets ``BENCH_THREAD_CPU_DIR``; Python then runs
this file in every process it starts. In a ``celery worker`` it starts a
daemon thread that, every 50 ms, notes the tasks received so far (Celery's
``Request`` objects made in this process), the process's CPU time, and
every 200 ms each of its threads' CPU and voluntary context switches
(``/proc/self/task``, by thread name) and its child processes' CPU (a
prefork pool). ``thread_cpu.py`` turns
the samples into microseconds per task between 10% and 90% of the tasks.
Elsewhere it does nothing.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

_OUT = os.environ.get("BENCH_THREAD_CPU_DIR")
_count = [0]


def _fields(stat_line: str) -> list[str]:
    """A /proc stat line's fields after the command name (state, ppid, ...)."""
    return stat_line.rpartition(")")[2].split()


def _ticks(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> float:
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                line = f.read()
        except OSError:
            continue
        fields = _fields(line)
        if int(fields[1]) == pid:
            total += _ticks(fields)
    return total


def _threads() -> tuple[dict[str, float], dict[str, int]]:
    """Each thread's CPU seconds, and how often it went to sleep (voluntary
    context switches: waiting for the GIL, a lock, a reply or its poll)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    found: dict[str, float] = {}
    sleeps: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        name = names.get(int(tid), tid)
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                found[name] = _ticks(_fields(f.read()))
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        sleeps[name] = int(line.split()[1])
        except OSError:
            pass
    return found, sleeps


def _count_requests() -> bool:
    module = sys.modules.get("celery.worker.request")
    request = getattr(module, "Request", None)
    if request is None:
        return False
    made = request.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _count[0] += 1
        made(self, *args, **kwargs)
    request.__init__ = __init__   # subclasses made per task type look it up here
    return True


def _sample(pid: int, pool: str) -> None:
    samples: list[Any] = []
    counting = False
    turn = 0
    while os.getpid() == pid:   # a forked child has no such thread anyway
        counting = counting or _count_requests()
        times = os.times()
        detail: dict[str, float] = {}
        sleeps: dict[str, int] = {}
        if turn % 4 == 0:
            detail, sleeps = _threads()
            detail["(children)"] = _children(pid)
        samples.append((time.monotonic(), times.user + times.system, _count[0], detail,
                        sleeps))
        turn += 1
        if turn % 10 == 0 and _count[0]:
            path = os.path.join(_OUT or ".", f"{pid}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({"pool": pool, "samples": samples}, f)
            os.replace(path + ".tmp", path)
        time.sleep(0.05)


if _OUT and "worker" in sys.argv:
    _pool = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--pool=")), "?")
    threading.Thread(target=_sample, args=(os.getpid(), _pool), daemon=True,
                     name="bench-thread-cpu").start()
