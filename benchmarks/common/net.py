"""Hosts apart on this machine: one network namespace per host on a bridge, and
partitions between them (the nemesis's faults; ``workers.py``'s replicated servers).

Every host (a ZooKeeper member, a worker machine, the publisher) gets a
network namespace ``czkn-{host}`` with a veth pair to the bridge ``czkn-br``
and one address of ``10.231.0.0/24``; this process keeps ``10.231.0.1`` on
the bridge, outside every partition, so it can always observe (four-letter
words, the final reads). Nothing reaches beyond loopback and these namespaces.

A partition is symmetric and silent: each side's namespace drops the other
side's packets in an nftables set (in and out), as a switch that lost a link
would; nothing answers with a reset, so clients find out by their timeouts.
Every name made here starts with :data:`PREFIX`, so :func:`remove_leftovers`
can clear what a run killed with SIGKILL left behind.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import shutil
import signal
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import IO

PREFIX = "czkn"
BRIDGE = f"{PREFIX}-br"
SUBNET = ipaddress.ip_network("10.231.0.0/24")
#: This process's address on the bridge: never partitioned.
OBSERVER = str(SUBNET.network_address + 1)
TABLE = "nemesis"


def run(*args: str, check: bool = True, input: str | None = None) -> str:
    done = subprocess.run(list(args), capture_output=True, text=True, input=input)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): "
                           f"{done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def ensure_tools() -> None:
    """Root, ``ip``, and ``nft`` (installed from Debian's nftables when missing)."""
    if os.geteuid() != 0:
        raise RuntimeError("hosts apart are network namespaces: run this as root")
    if shutil.which("ip") is None:
        raise RuntimeError("hosts apart need iproute2's ip (apt-get install iproute2)")
    if shutil.which("nft") is None:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "nftables"]):
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise RuntimeError(f"nft is missing and {' '.join(cmd)} failed: "
                                   f"{done.stderr.strip()[-500:]}; install nftables")


@dataclass(frozen=True)
class Host:
    """One machine of the run: a namespace with one address."""

    name: str
    address: str

    @property
    def namespace(self) -> str:
        return f"{PREFIX}-{self.name}"

    @property
    def link(self) -> str:
        """The veth end on the bridge, named as the namespace (its other end: ``{link}p``)."""
        return self.namespace

    def exec_prefix(self) -> list[str]:
        """A command prefix that runs (execs) a program inside this host."""
        return ["ip", "netns", "exec", self.namespace]


LOCK_PATH = f"/run/lock/celery_zk-{PREFIX}.lock"


def exclusive() -> IO[str]:
    """Hold the lock of the ``czkn-*`` names for this run (until the returned file
    is closed, or the process ends): a second run would tear the first one down."""
    os.makedirs(os.path.dirname(LOCK_PATH), exist_ok=True)
    lock = open(LOCK_PATH, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip()
        lock.close()
        raise RuntimeError(f"another run with hosts apart (pid {holder or '?'}) holds "
                           f"{LOCK_PATH}: its namespaces are named like ours; wait for it "
                           "to end") from None
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def namespaces() -> list[str]:
    return [line.split()[0] for line in run("ip", "netns", "list").splitlines() if line.strip()]


def remove_leftovers() -> list[str]:
    """Kill every process inside a ``czkn-*`` namespace and delete the namespaces and
    the bridge: what a previous run that could not clean up (SIGKILL) left."""
    removed = []
    for ns in namespaces():
        if not ns.startswith(f"{PREFIX}-"):
            continue
        for pid in run("ip", "netns", "pids", ns, check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        run("ip", "netns", "del", ns, check=False)
        removed.append(ns)
    for line in run("ip", "-o", "link", "show").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(f"{PREFIX}-"):
            run("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


class Network:
    """The bridge, the hosts' namespaces, and the partitions now in force."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(names) > 250:
            raise ValueError("at most 250 hosts on one /24")
        self.hosts = {name: Host(name, str(SUBNET.network_address + 2 + i))
                      for i, name in enumerate(names)}
        #: {host: hosts it cannot reach}; symmetric.
        self.cut_off: dict[str, set[str]] = {name: set() for name in names}
        self.up = False

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def create(self) -> None:
        self.up = True   # from the first command on, destroy() has something to undo
        run("ip", "link", "add", BRIDGE, "type", "bridge")
        run("ip", "addr", "add", f"{OBSERVER}/{SUBNET.prefixlen}", "dev", BRIDGE)
        run("ip", "link", "set", BRIDGE, "up")
        for host in self.hosts.values():
            ns, inner = host.namespace, f"{host.link}p"
            run("ip", "netns", "add", ns)
            run("ip", "link", "add", host.link, "type", "veth", "peer", "name", inner,
                "netns", ns)
            run("ip", "link", "set", host.link, "master", BRIDGE, "up")
            run("ip", "-n", ns, "addr", "add", f"{host.address}/{SUBNET.prefixlen}",
                "dev", inner)
            run("ip", "-n", ns, "link", "set", inner, "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
            # Input and output: a dropped SYN or a dropped reply, either way silence.
            self._nft(host, f"""
                table inet {TABLE} {{
                  set blocked {{ type ipv4_addr; }}
                  chain out {{ type filter hook output priority 0; ip daddr @blocked drop; }}
                  chain in {{ type filter hook input priority 0; ip saddr @blocked drop; }}
                }}""")

    def _nft(self, host: Host, script: str) -> None:
        run(*host.exec_prefix(), "nft", "-f", "-", input=script)

    def _apply(self, name: str) -> None:
        host = self.hosts[name]
        blocked = ", ".join(self.hosts[other].address for other in sorted(self.cut_off[name]))
        script = f"flush set inet {TABLE} blocked\n"
        if blocked:
            script += f"add element inet {TABLE} blocked {{ {blocked} }}\n"
        self._nft(host, script)

    def cut(self, side_a: Iterable[str], side_b: Iterable[str]) -> None:
        """No packet between any host of ``side_a`` and any of ``side_b`` (added to
        the partitions in force)."""
        side_a, side_b = set(side_a), set(side_b)
        if side_a & side_b:
            raise ValueError(f"a host on both sides: {sorted(side_a & side_b)}")
        for a in side_a:
            self.cut_off[a] |= side_b
        for b in side_b:
            self.cut_off[b] |= side_a
        for name in side_a | side_b:
            self._apply(name)

    def heal(self) -> None:
        """Every partition lifted."""
        changed = [name for name, blocked in self.cut_off.items() if blocked]
        for name in changed:
            self.cut_off[name] = set()
            self._apply(name)

    def destroy(self) -> None:
        """Kill whatever still runs in the namespaces, delete them and the bridge."""
        if not self.up:
            return
        self.up = False
        for host in self.hosts.values():
            for pid in run("ip", "netns", "pids", host.namespace, check=False).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            # The pair goes with either end, but a namespace's end is destroyed
            # lazily by the kernel: delete ours so nothing is left when we return.
            run("ip", "link", "del", host.link, check=False)
            run("ip", "netns", "del", host.namespace, check=False)
        run("ip", "link", "del", BRIDGE, check=False)
