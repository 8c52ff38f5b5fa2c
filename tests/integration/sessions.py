"""ZooKeeper sessions as the server sees them: per process, and apart in one process.

``cons`` (a four-letter word the test server allows) lists the server's
connections with their client ports; ``/proc`` maps a port to the process
that owns the socket, so a test can count sessions per process, as an
operator would count connections per client IP against ``maxClientCnxns``.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from kazoo.client import KazooClient

from celery_zk.server import four_letter_word

_CONS_RE = re.compile(r"^\s*/([0-9.]+):(\d+)\[\d+\]\((.*)\)\s*$")


def apart(url: str, name: str) -> str:
    """``url`` for a connection standing for another process: a session of its own.

    In one process every connection shares one session (celery_zk.zk.session);
    a test that plays two processes in one gives the second its own. The name
    holds a hash of the URL (its chroot): sessions are shared by what names the
    hosts, not the root, and one test's session must never be another's.
    """
    import hashlib

    unique = f"{name}-{hashlib.sha1(url.encode()).hexdigest()[:8]}"
    return f"{url}{'&' if '?' in url else '?'}session_name={unique}"


def session_ports(host: str, port: int) -> list[int]:
    """Client ports of every connection that holds a session (``cons``)."""
    ports = []
    for line in four_letter_word(host, port, "cons").splitlines():
        match = _CONS_RE.match(line)
        if match and "sid=" in match.group(3):
            ports.append(int(match.group(2)))
    return ports


def _socket_inodes_by_port(server_port: int) -> dict[int, int]:
    """The inode of each socket connected to ``server_port``, by its local port.
    Only those: another socket may have the same local port (one in TIME_WAIT,
    inode 0, or one to another server), and taking it instead counted a live
    session as nobody's."""
    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local_port = int(fields[1].rpartition(":")[2], 16)
            remote_port = int(fields[2].rpartition(":")[2], 16)
            inode = int(fields[9])
            if remote_port == server_port and inode:
                inodes[local_port] = inode
    return inodes


def _pid_of_inode() -> dict[int, int]:
    owners = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owners[int(target[8:-1])] = int(entry.name)
        except OSError:
            continue
    return owners


def sessions_by_pid(host: str, port: int) -> Counter[int]:
    """How many ZooKeeper sessions each process on this machine holds."""
    ports = session_ports(host, port)
    inodes, owners = _socket_inodes_by_port(port), _pid_of_inode()
    return Counter(owners.get(inodes.get(p, -1), -1) for p in ports)


def process_tree(pid: int) -> set[int]:
    """``pid`` and every descendant (a prefork worker and its pool children)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = set(), [pid]
    while todo:
        current = todo.pop()
        tree.add(current)
        todo += children.get(current, [])
    return tree


def count(sessions: Counter[int], pids: Iterable[int]) -> int:
    return sum(sessions[p] for p in pids)


def expire(client: KazooClient) -> None:
    """End ``client``'s session as the server would on a timeout: another client
    takes the session over and closes it (``client`` then gets a new one)."""
    twin = KazooClient(hosts=",".join(f"{h}:{p}" for h, p in client.hosts),
                       client_id=client.client_id)
    twin.start(timeout=10)
    twin.stop()
    twin.close()
