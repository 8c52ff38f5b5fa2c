"""The nemesis's machines: a ZooKeeper ensemble, ``celery worker`` hosts and a publisher,
each in its own network namespace (:mod:`common.net`).

Every process is started through ``ip netns exec`` (which execs it, so the
pid is the program's) in a process group of its own: a kill or a pause
reaches the worker and its pool children at once, as a crash or a frozen
machine would. Outputs are appended to ``{work_dir}/{host}.log`` across
restarts.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from common.net import Network
from common.processes import BENCHMARKS, child_env
from kazoo.client import KazooClient

from celery_zk.server import JVM_FLAGS, ZooKeeperEnsemble

from .dispatcher import Lookup

ROOT = "/nemesis"
#: The launcher's fast-start flags with a smaller heap: three members share the machine.
ZK_JVM_FLAGS = (*[f for f in JVM_FLAGS if not f.startswith("-Xm")], "-Xms32m", "-Xmx256m")
SESSION_TIMEOUT = 10.0   # celery_zk's default: what pauses and partitions must outlast


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    pool: str
    concurrency: int = 2


def group_pids(pgid: int) -> list[int]:
    """Live processes of a process group (a worker and its pool children)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    fields = fh.read().rpartition(b")")[2].split()
                if int(fields[2]) == pgid and fields[0] != b"Z":
                    pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return pids


class HostProcess:
    """A program that runs on one host, in a process group of its own."""

    def __init__(self, name: str, prefix: Sequence[str], args: Sequence[str], log_path: str,
                 env: dict[str, str], ready_file: str) -> None:
        self.name = name
        self.args = [*prefix, *args]
        self.log_path = log_path
        self.env = env
        self.ready_file = ready_file
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.paused = False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running and self.proc else None

    def start(self, timeout: float = 90) -> None:
        if os.path.exists(self.ready_file):
            os.unlink(self.ready_file)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, env=self.env, cwd=BENCHMARKS,
                                     stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.paused = False
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.ready_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not become ready (exit "
                                   f"{self.proc.poll()}); see {self.log_path}")
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL the group: the machine crashed."""
        self.signal(signal.SIGKILL)
        self._reap(10)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self.signal(signal.SIGCONT)
        self.paused = False

    def stop(self, grace: float = 30) -> None:
        """Warm shutdown (SIGTERM), SIGKILL after ``grace``."""
        if self.paused:
            self.resume()
        self.signal(signal.SIGTERM)
        self._reap(grace)

    def _reap(self, grace: float) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
            self.signal(signal.SIGKILL)   # and whatever of its group is left
            self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


class Cluster:
    """The ensemble on ``zk_hosts``, a worker on each of ``workers``, the publisher."""

    def __init__(self, work_dir: str, net: Network, zk_hosts: Sequence[str],
                 workers: Sequence[WorkerSpec], publisher_host: str, *,
                 dedupe: bool = True) -> None:
        self.work_dir = work_dir
        self.net = net
        self.zk_hosts = list(zk_hosts)
        self.ensemble = ZooKeeperEnsemble(
            hosts=[net[h].address for h in zk_hosts],
            command_prefixes=[net[h].exec_prefix() for h in zk_hosts],
            data_dir=os.path.join(work_dir, "zk"), jvm_flags=ZK_JVM_FLAGS)
        for member, host in zip(self.ensemble.members, zk_hosts):
            member.log_path = os.path.join(work_dir, f"{host}.log")
        self.hosts = self.ensemble.hosts
        self.url = f"zk://{self.hosts}{ROOT}"
        env = child_env({"NEMESIS_URL": self.url, "NEMESIS_DIR": work_dir,
                         "NEMESIS_DEDUPE": "1" if dedupe else "0"})
        self.specs = {spec.name: spec for spec in workers}
        self.workers = {
            spec.name: HostProcess(
                spec.name, net[spec.name].exec_prefix(),
                [sys.executable, "-m", "celery", "-A", "nemesis.app", "worker",
                 f"--pool={spec.pool}", "-c", str(spec.concurrency), "--loglevel=INFO",
                 f"--hostname={spec.name}@%h", "--without-mingle", "--without-gossip",
                 "--without-heartbeat"],
                os.path.join(work_dir, f"{spec.name}.log"),
                dict(env, NEMESIS_HOST=spec.name,
                     NEMESIS_READY_FILE=os.path.join(work_dir, f"{spec.name}.ready")),
                ready_file=os.path.join(work_dir, f"{spec.name}.ready"))
            for spec in workers}
        self.publisher_host = publisher_host
        self.publisher: HostProcess | None = None
        self._env = env
        self.observer: KazooClient | None = None

    # -- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        self.ensemble.start(timeout=120)
        self.observer = KazooClient(self.hosts, timeout=SESSION_TIMEOUT)
        self.observer.start(timeout=30)
        for worker in self.workers.values():
            worker.start()

    def start_publisher(self, rate: float, seed: int) -> None:
        ready = os.path.join(self.work_dir, "publisher.ready")
        self.publisher = HostProcess(
            "publisher", self.net[self.publisher_host].exec_prefix(),
            [sys.executable, "-m", "nemesis.publisher", "--rate", str(rate),
             "--seed", str(seed)],
            os.path.join(self.work_dir, "publisher.log"),
            dict(self._env, NEMESIS_READY_FILE=ready), ready_file=ready)
        self.publisher.start()

    def stop_publisher(self) -> None:
        if self.publisher is not None:
            self.publisher.stop(grace=60)

    def stop_workers(self) -> None:
        # All at once: a worker's warm shutdown must not wait on another's.
        for worker in self.workers.values():
            if worker.paused:
                worker.resume()
            worker.signal(signal.SIGTERM)
        for worker in self.workers.values():
            worker.stop()

    def stop(self) -> None:
        """Everything, whatever state it is in (for the finally block)."""
        for proc in [self.publisher, *self.workers.values()]:
            if proc is not None:
                proc.stop(grace=15)
        if self.observer is not None:
            try:
                self.observer.stop()
                self.observer.close()
            except Exception:
                pass
            self.observer = None
        for member in self.ensemble.members:   # a paused JVM ignores SIGTERM
            if member.pid is not None:
                try:
                    os.killpg(member.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        self.ensemble.stop()

    # -- who is who ---------------------------------------------------------------
    def zk_leader(self) -> int | None:
        """The leading member's index (by ``srvr``), or None while there is none."""
        modes = [self.ensemble.mode(i) for i in range(len(self.ensemble.members))]
        leaders = [i for i, mode in enumerate(modes) if mode == "leader"]
        return leaders[0] if len(leaders) == 1 else None

    def worker_of_pid(self, pid: int) -> str | None:
        for name, worker in self.workers.items():
            if worker.pid is not None and pid in group_pids(worker.pid):
                return name
        return None

    def dispatcher_holder(self, lookup: Lookup, queue: str = "celery"
                          ) -> tuple[str | None, bool]:
        """(the worker host whose process holds ``queue``'s dispatcher role, is it the
        holder itself): the next in line when the holder is a process that just
        died (its node stays until its session expires)."""
        assert self.observer is not None
        try:
            pids = lookup(self.observer, ROOT, queue)
        except Exception:   # no quorum at this instant: no favoured target
            return None, False
        for rank, pid in enumerate(pids):
            host = self.worker_of_pid(pid)
            if host is not None:
                return host, rank == 0
        return None, False
