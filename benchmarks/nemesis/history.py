"""The nemesis's history: append-only journals of JSON lines, each synced before it counts.

The publisher writes one line per ``apply_async`` that returned (and per
revoke, publish retry and failed publish); every worker process appends one
line when a task starts and one when it ends, to its host's journal. A line
is written with one ``write()`` on an ``O_APPEND`` descriptor (lines of
several processes never interleave) and ``fsync``'d before the task goes on,
so a process killed with SIGKILL has lost nothing it recorded. A reader skips
a last line without its newline: the writer died in the middle of it.
"""
from __future__ import annotations

import glob
import json
import os
import threading
import time
from typing import Any

#: Journal names: ``publisher.jsonl`` and ``exec-{host}.jsonl``.
PUBLISHER = "publisher.jsonl"
EXEC_PATTERN = "exec-*.jsonl"


def exec_journal(directory: str, host: str) -> str:
    return os.path.join(directory, f"exec-{host}.jsonl")


class Journal:
    """One process's handle on an append-only journal (reopened after a fork)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1
        self._pid = 0
        self._lock = threading.Lock()

    def write(self, **entry: Any) -> None:
        """Append ``entry`` with ``t`` (now, unless given); returns once it is on disk."""
        entry.setdefault("t", time.time())
        line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._pid != os.getpid():   # a forked pool child: a descriptor of its own
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                self._pid = os.getpid()
            os.write(self._fd, line)
            os.fsync(self._fd)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0 and self._pid == os.getpid():
                os.close(self._fd)
            self._fd = -1


def read_journal(path: str) -> list[dict[str, Any]]:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return []
    whole = data.rpartition(b"\n")[0]   # after the last newline: a line cut by a kill
    return [json.loads(line) for line in whole.split(b"\n") if line.strip()]


class Follower:
    """Reads what the worker journals gained since the last look (whole lines only)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._offsets: dict[str, int] = {}

    def new_entries(self) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = []
        for path in sorted(glob.glob(os.path.join(self.directory, EXEC_PATTERN))):
            with open(path, "rb") as fh:
                fh.seek(self._offsets.get(path, 0))
                data = fh.read()
            whole, _, _ = data.rpartition(b"\n")
            if whole:
                self._offsets[path] = self._offsets.get(path, 0) + len(whole) + 1
                entries += [json.loads(line) for line in whole.split(b"\n") if line.strip()]
        return entries


def read_executions(directory: str) -> list[dict[str, Any]]:
    """Every worker journal's lines, in time order."""
    entries: list[dict[str, Any]] = []
    for path in sorted(glob.glob(os.path.join(directory, EXEC_PATTERN))):
        entries += read_journal(path)
    entries.sort(key=lambda e: e["t"])
    return entries
