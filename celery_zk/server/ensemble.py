"""A local ZooKeeper quorum for fault-injection tests.

Every member is a :class:`~celery_zk.server.ZooKeeperServer` with a ``myid``
and the shared ``server.N`` lines; this module only adds what a quorum needs
on top: port allocation, waiting for a leader, and stopping/starting members.
Given ``hosts`` (one address per member), every member binds its own address
and all use the same three ports, as on separate machines. See
``docs/launcher.md``, "Ensembles".
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence

from ..exceptions import ServerStartError
from .install import JVM_FLAGS, find_zookeeper
from .launcher import Launched, Peer, ZooKeeperServer, four_letter_word, free_ports

__all__ = ["ZooKeeperEnsemble"]

_MODE = re.compile(r"^Mode: (\w+)", re.MULTILINE)


class ZooKeeperEnsemble(Launched):
    """``size`` ZooKeeper servers forming one quorum: on one loopback address, or
    each on its own address of ``hosts``.

    Members are indexed from 0 (their ZooKeeper ``myid`` is index + 1).
    """

    def __init__(self, size: int = 3, data_dir: str | None = None,
                 host: str = "127.0.0.1", tick_time: int = 2000,
                 extra_config: dict[str, str] | None = None, *,
                 hosts: Sequence[str] | None = None,
                 command_prefixes: Sequence[Sequence[str]] | None = None,
                 jvm_flags: Sequence[str] = JVM_FLAGS) -> None:
        if hosts is not None:
            size = len(hosts)
            if len(set(hosts)) != size:
                raise ValueError(f"hosts must be one distinct address per member, not {hosts}")
        if size < 1:
            raise ValueError(f"an ensemble needs at least one member, not {size}")
        if command_prefixes is not None and len(command_prefixes) != size:
            raise ValueError(f"command_prefixes needs one entry per member ({size}), "
                             f"not {len(command_prefixes)}")
        self.data_dir = (self._make_temp_dir("celery-zk-ensemble-") if data_dir is None
                         else os.path.abspath(data_dir))
        if hosts is None:
            addresses = [host] * size
            ports = free_ports(3 * size, host)
            client_ports, quorum_ports = ports[:size], ports[size:]
            peers = [Peer(i + 1, host, quorum_ports[2 * i], quorum_ports[2 * i + 1])
                     for i in range(size)]
        else:
            # Distinct addresses: one free triple (here, in our own namespace) serves
            # them all, as the well-known 2181/2888/3888 serve separate machines.
            addresses = list(hosts)
            client, quorum, election = free_ports(3)
            client_ports = [client] * size
            peers = [Peer(i + 1, address, quorum, election)
                     for i, address in enumerate(addresses)]
        install = find_zookeeper()
        self.members: list[ZooKeeperServer] = [
            ZooKeeperServer(port=client_ports[i], data_dir=os.path.join(self.data_dir,
                                                                         f"node{i + 1}"),
                            host=addresses[i], tick_time=tick_time, extra_config=extra_config,
                            server_id=i + 1, peers=peers, install=install,
                            jvm_flags=jvm_flags,
                            command_prefix=command_prefixes[i] if command_prefixes else ())
            for i in range(size)
        ]

    @property
    def running(self) -> bool:
        return any(member.running for member in self.members)

    @property
    def hosts(self) -> str:
        return ",".join(member.hosts for member in self.members)

    @property
    def url(self) -> str:
        return f"zk://{self.hosts}"

    def mode(self, index: int) -> str:
        """"leader", "follower", ... or "down" when the member does not serve."""
        member = self.members[index]
        try:
            found = _MODE.search(four_letter_word(member.host, member.client_port, "srvr"))
        except OSError:
            return "down"
        return found.group(1) if found else "down"

    def leader_index(self) -> int:
        leaders = [i for i in range(len(self.members)) if self.mode(i) == "leader"]
        if len(leaders) != 1:
            raise LookupError(f"expected one leader in {self.hosts}, found members "
                              f"{leaders}; call wait_for_quorum() first")
        return leaders[0]

    def wait_for_quorum(self, timeout: float = 60) -> int:
        """Wait until every running member serves and one leads; return its index."""
        deadline = time.monotonic() + timeout
        while True:
            running = [i for i, m in enumerate(self.members) if m.running]
            modes = {i: self.mode(i) for i in running}
            leaders = [i for i, mode in modes.items() if mode == "leader"]
            if len(leaders) == 1 and all(m in ("leader", "follower") for m in modes.values()):
                return leaders[0]
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- member {i} ({self.members[i].log_path}):\n"
                                 f"{self.members[i].read_log(last_lines=20)}" for i in running)
                raise ServerStartError(
                    f"ZooKeeper ensemble {self.hosts} has no quorum after {timeout}s "
                    f"(modes: {modes}). Member log tails:\n{logs}")
            time.sleep(0.2)

    def start(self, timeout: float = 60) -> ZooKeeperEnsemble:
        try:
            for member in self.members:
                member.spawn()  # all at once: a lone member cannot elect a leader
            for member in self.members:
                member.wait_ready(timeout, serving=False)
            self.wait_for_quorum(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop_member(self, index: int) -> None:
        self.members[index].stop()

    def kill_member(self, index: int) -> None:
        """SIGKILL a member (a crash); ``start_member`` brings it back."""
        self.members[index].kill()

    def start_member(self, index: int, timeout: float = 60) -> None:
        """Restart a stopped member on its data dir; it rejoins the quorum."""
        self.members[index].start(timeout)
        self.wait_for_quorum(timeout)

    def stop(self) -> None:
        for member in self.members:
            member.stop()

