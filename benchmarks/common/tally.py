"""Tasks run by many worker processes, counted in one file they all map (``workers.py``).

A drain spread over K worker processes (or a prefork pool's children) has no
single process that sees every task. Each process therefore claims a slot of
a shared file (executions, first and last start on CLOCK_MONOTONIC, the same
clock in every process) and marks each task index it ran in a byte per task.
The client maps the same file and polls it: no syscall per task, no lock
between processes (each writes only its own slot and bytes that only ever go
from 0 to 1), so counting does not slow the drain it measures.
"""
from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass

SLOTS = 64                         # processes per drain (16 workers × a prefork pool fits)
SLOT = struct.Struct("<qdd")       # executions, first start, last start
HEADER = SLOTS * SLOT.size


class _Mapped:
    """This process's slot (a threads pool runs tasks on several threads: the lock)."""

    lock = threading.Lock()
    pid = 0
    path = ""
    mm: mmap.mmap | None = None
    offset = 0


def _claim_slot(path: str) -> int:
    """The first free slot: an O_EXCL file per slot, so two processes never share one."""
    for slot in range(SLOTS):
        try:
            os.close(os.open(f"{path}.slot{slot}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return slot
        except FileExistsError:
            continue
    raise RuntimeError(f"{path}: more than {SLOTS} processes ran tasks of one drain")


def record(path: str, index: int) -> None:
    """Worker side: task ``index`` started now in this process."""
    now = time.monotonic()
    state = _Mapped
    with state.lock:
        if state.pid != os.getpid() or state.path != path:   # a forked child: its own slot
            with open(path, "r+b") as fh:
                state.mm = mmap.mmap(fh.fileno(), 0)
            state.pid, state.path = os.getpid(), path
            state.offset = _claim_slot(path) * SLOT.size
        mm = state.mm
        assert mm is not None
        count, first, _ = SLOT.unpack_from(mm, state.offset)
        SLOT.pack_into(mm, state.offset, count + 1, first if count else now, now)
        mm[HEADER + index] = 1


@dataclass
class Summary:
    executions: int
    distinct: int
    processes: int       # slots used: processes that ran at least one task
    first: float         # CLOCK_MONOTONIC of the first task start, any process
    last: float


class Tally:
    """Client side: the file of one drain of ``total`` tasks (indexes 0 .. total-1)."""

    def __init__(self, path: str, total: int) -> None:
        self.path, self.total = path, total
        with open(path, "wb") as fh:
            fh.truncate(HEADER + total)
        with open(path, "r+b") as fh:
            self.mm = mmap.mmap(fh.fileno(), 0)

    def _slots(self) -> list[tuple[int, float, float]]:
        return [s for s in SLOT.iter_unpack(self.mm[:HEADER]) if s[0]]

    def started(self) -> bool:
        return bool(self._slots())

    def executions(self) -> int:
        """Task starts so far, every process counted."""
        return sum(s[0] for s in self._slots())

    def done(self) -> bool:
        """Every index ran at least once."""
        return self.mm.find(b"\0", HEADER) < 0

    def summary(self) -> Summary:
        slots = self._slots()
        return Summary(executions=sum(s[0] for s in slots),
                       distinct=self.total - self.mm[HEADER:].count(0),
                       processes=len(slots), first=min(s[1] for s in slots),
                       last=max(s[2] for s in slots))

    def close(self) -> None:
        self.mm.close()
        for slot in range(SLOTS):
            try:
                os.remove(f"{self.path}.slot{slot}")
            except FileNotFoundError:
                pass
