"""The measured servers: ZooKeeper as users run it, ``redis-server`` and a private RabbitMQ node.

Each on free ports, started by :func:`start_server` (one, for scripts that
run the brokers back to back) or :func:`start_servers` (all at once), each
with its stop on a list the caller unwinds, also after an error or Ctrl-C.
zk is ZooKeeper's defaults with production JVM flags and ``forceSync``,
warmed up first (:func:`warm_up_zookeeper`, then a worker under the steady
load: :func:`common.load.warm_up_with_load`); Redis runs without persistence,
or with ``redis-aof`` every write synced; RabbitMQ is Debian's
``rabbitmq-server`` in the foreground, durable queues as Celery declares them.

The production shape: ``zk3``, ZooKeeper's three-member ensemble, and
``rabbitmq3``, RabbitMQ's three-node cluster with quorum queues, each member
on a host of its own. The hosts are network namespaces on one bridge
(:mod:`common.net`), made at the first replicated server a run starts and
deleted at its end. Clients (the workers, the script) stay on this host and
reach the members over the bridge, as clients on other machines would, with
every member in their URL (kazoo picks one at random; kombu takes the first
and fails over to the next).

* ``zk3``: three members with ``zk``'s settings (ZooKeeper's defaults,
  ``forceSync``, production JVM flags), warmed up as ``zk`` is.
* ``rabbitmq3``: three nodes joined into one cluster; its URL
  (:data:`common.app.QUORUM`) makes Celery declare quorum queues
  (:func:`common.app.make_app`) and confirm every publish, the promise a
  replicated ZooKeeper makes. Results go by ``rpc://``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_zk.server import (
    SERVER_JVM_FLAGS,
    ZooKeeperEnsemble,
    ZooKeeperServer,
    four_letter_word,
    free_ports,
)

from . import txnlog
from .app import QUORUM
from .figures import log
from .net import Host, Network, ensure_tools, exclusive, remove_leftovers
from .processes import Processes, tail

REDIS_SERVER = "/usr/bin/redis-server"
WARM_UP_SECONDS = 3.0


def add_server_options(parser: argparse.ArgumentParser, started: bool = True) -> None:
    """The measured ZooKeeper's settings; with ``started`` (scripts that start it
    by :func:`start_server`) its warm-up and a celery_zk option for its URLs."""
    parser.add_argument("--zk-force-sync", choices=("yes", "no"), default="yes",
                        help="ZooKeeper's forceSync (fsync every write; default yes)")
    parser.add_argument("--zk-jvm-flag", action="append", default=[], metavar="FLAG",
                        help="extra JVM flag for the ZooKeeper server, repeatable, e.g. "
                             "-Dzookeeper.commitProcessor.numWorkerThreads=0")
    if not started:
        return
    parser.add_argument("--zk-warm-up", type=float, default=30.0, metavar="SECONDS",
                        help="before measuring zk, run a worker under a steady load for "
                             "this long: the server's JIT compiles its request path "
                             "meanwhile, as a server running for days has (default 30)")
    parser.add_argument("--zk-option", action="append", default=[], metavar="KEY=VALUE",
                        help="celery_zk option for the zk broker and backend URLs, "
                             "repeatable, e.g. handoff=false")


def choose(parser: argparse.ArgumentParser, value: str, known: Sequence[str]) -> list[str]:
    """The comma-separated names in ``value`` (``--brokers``, ``--only``), each one of
    ``known``: else the parser's usage error."""
    names = [name for name in value.split(",") if name]
    for name in names:
        if name not in known:
            parser.error(f"unknown {name!r}: choose from {', '.join(known)}")
    return names


def measured_settings(args: argparse.Namespace) -> dict[str, Any]:
    """A production-like server's: full JIT, default GC, ZooKeeper's default tickTime
    (a member of ``zk3`` has them too)."""
    return {"extra_config": {"forceSync": args.zk_force_sync},
            "jvm_flags": (*SERVER_JVM_FLAGS, *args.zk_jvm_flag), "tick_time": 2000}


def measured_server(args: argparse.Namespace) -> ZooKeeperServer:
    """One production-like server (:func:`measured_settings`)."""
    return ZooKeeperServer(**measured_settings(args))


def warm_up_zookeeper(hosts: str) -> None:
    """A few seconds of the writes and reads the brokers do, so the JVM has loaded
    its request path before the first measurement."""
    from kazoo.client import KazooClient
    log(f"warming up ZooKeeper for {WARM_UP_SECONDS:.0f}s")
    client = KazooClient(hosts)
    client.start()
    try:
        client.ensure_path("/bench-warm-up/owned")
        deadline = time.monotonic() + WARM_UP_SECONDS
        while time.monotonic() < deadline:
            paths = [r.get() for r in [client.create_async("/bench-warm-up/m-", b"x" * 1000,
                                                           sequence=True) for _ in range(50)]]
            client.get_children("/bench-warm-up")
            for path in paths:
                txn = client.transaction()
                txn.delete(path)
                txn.create("/bench-warm-up/owned/" + path.rpartition("/")[2], b"x" * 1000)
                txn.commit()
        client.delete("/bench-warm-up", recursive=True)
    finally:
        client.stop()
        client.close()


def close_sessions(hosts: str) -> None:
    """End this process's celery_zk sessions on ``hosts`` before their server stops:
    kombu's pools keep connections for the life of the process, whose sessions
    would retry against a stopped server."""
    try:   # not a public name: the only one of celery_zk's internals named here
        from celery_zk.zk.session import close_all
    except ImportError:   # a checkout without it (the scripts measure other checkouts)
        return
    close_all(hosts)


class RedisServer:
    """``redis-server`` on a free port: no persistence (as most users run it), or with
    ``durable`` an append-only file synced on every write (``appendfsync always``)."""

    def __init__(self, procs: Processes, work_dir: str, durable: bool = False) -> None:
        self.procs = procs
        self.port = free_ports(1)[0]
        self.durable = durable
        self.dir = os.path.join(work_dir, f"redis-{self.port}")
        self.log_path = os.path.join(work_dir, f"redis-{self.port}.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> RedisServer:
        persistence = (["--appendonly", "yes", "--appendfsync", "always"] if self.durable
                       else ["--appendonly", "no"])
        os.makedirs(self.dir, exist_ok=True)
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--save", "", *persistence, "--daemonize", "no"]
        self.proc = self.procs.spawn(args, self.log_path)
        import redis
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=1).ping()
                return self
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not start:\n{tail(self.log_path)}") from None
                time.sleep(0.05)

    def version(self) -> str:
        import redis
        return str(redis.Redis(port=self.port).info("server")["redis_version"])


class RabbitServer:
    """A private RabbitMQ node in the foreground (Debian's wrapper runs it as user
    rabbitmq, so its directories are that user's): on this host's loopback, or
    on ``host``, a network namespace (:mod:`common.net`), named by its address."""

    def __init__(self, procs: Processes, work_dir: str, host: Host | None = None) -> None:
        if shutil.which("rabbitmq-server") is None:
            raise RuntimeError("rabbitmq-server not found: install Debian's package "
                               "(apt-get install rabbitmq-server), or leave rabbitmq out "
                               "with --brokers")
        self.procs = procs
        self.port, dist = free_ports(2)
        self.host = host
        self.address = host.address if host else "127.0.0.1"
        self.node = f"rabbit@{host.address}" if host else f"scale{self.port}@localhost"
        self.base = os.path.join(work_dir, f"rabbitmq-{self.port}")
        os.chmod(work_dir, 0o755)   # mkdtemp's 0700 would keep user rabbitmq out
        os.makedirs(os.path.join(self.base, "log"))
        open(os.path.join(self.base, "enabled_plugins"), "w").write("[].")
        # guest logs in from any host: clients reach a node on a host apart over the bridge
        open(os.path.join(self.base, "rabbitmq.conf"), "w").write("loopback_users = none\n")
        shutil.chown(self.base, "rabbitmq", "rabbitmq")
        for name in os.listdir(self.base):
            shutil.chown(os.path.join(self.base, name), "rabbitmq", "rabbitmq")
        self.env = dict(os.environ, RABBITMQ_NODE_PORT=str(self.port),
                        RABBITMQ_NODENAME=self.node, RABBITMQ_DIST_PORT=str(dist),
                        RABBITMQ_USE_LONGNAME="true" if host else "false",
                        RABBITMQ_MNESIA_BASE=os.path.join(self.base, "mnesia"),
                        RABBITMQ_LOG_BASE=os.path.join(self.base, "log"),
                        RABBITMQ_ENABLED_PLUGINS_FILE=os.path.join(self.base, "enabled_plugins"),
                        RABBITMQ_CONFIG_FILE=os.path.join(self.base, "rabbitmq.conf"),
                        RABBITMQ_FEATURE_FLAGS_FILE=os.path.join(self.base, "feature_flags"))
        self.out = self.base + ".out"
        self.proc: subprocess.Popen[bytes] | None = None
        self.beam = 0   # the node's OS pid
        self.epmd_before: set[int] = set()

    def url(self) -> str:
        return f"amqp://guest:guest@{self.address}:{self.port}//"

    def run_ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["rabbitmqctl", "-n", self.node, *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def ctl(self, *args: str) -> str:
        return self.run_ctl(*args).stdout

    def start(self) -> RabbitServer:
        self.spawn()
        return self.await_startup()

    def spawn(self) -> None:
        self.epmd_before = epmd_pids()
        prefix = self.host.exec_prefix() if self.host else []
        self.proc = self.procs.spawn([*prefix, "rabbitmq-server"], self.out, self.env)

    def await_startup(self) -> RabbitServer:
        assert self.proc is not None
        deadline = time.monotonic() + 120
        while True:   # await_startup fails at once until the node is known to epmd
            result = self.run_ctl("await_startup", "--timeout", "10", timeout=30)
            if result.returncode == 0:
                self.beam = int(self.ctl("eval", "os:getpid().").strip().strip('"'))
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"RabbitMQ did not start:\n{tail(self.out)}\n"
                                   f"{result.stdout}{result.stderr}")
            time.sleep(1)

    def stop(self) -> None:
        self.stop_node()
        stop_new_epmds(self.epmd_before)

    def stop_node(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.run_ctl("stop")
            self.procs.stop(self.proc)
        if self.beam:   # su runs the node in a session of its own: wait for it by pid
            deadline = time.monotonic() + 30
            while os.path.exists(f"/proc/{self.beam}") and time.monotonic() < deadline:
                time.sleep(0.2)
            try:
                os.kill(self.beam, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.beam = 0

    def version(self) -> str:
        return self.ctl("version").strip()

    def memory(self) -> int:
        """Bytes the node uses (its own total, as `rabbitmqctl status` reports)."""
        out = self.ctl("eval", "erlang:memory(total).")
        return int(out.strip().rstrip("."))


def epmd_pids() -> set[int]:
    found = subprocess.run(["pgrep", "-x", "epmd"], capture_output=True, text=True).stdout
    return {int(pid) for pid in found.split()}


def stop_new_epmds(before: set[int]) -> None:
    """A node starts epmd for its whole host (a daemon: not our child), and so does
    ``rabbitmqctl``: stop the ones not running ``before``, by pid."""
    for pid in epmd_pids() - before:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def hosts_of(members: Sequence[ZooKeeperServer]) -> str:
    """ZooKeeper members' ``host:port`` list, as a kazoo client takes it."""
    return ",".join(member.hosts for member in members)


@dataclass
class Server:
    """A broker's server, started: the URLs its clients use and how it stops."""

    name: str
    url: str
    backend: str   # the broker's own kind of result backend (RabbitMQ: rpc://)
    version: str
    stop: Callable[[], None]
    pids: list[int]   # the server's processes (their process groups count as the server)
    zk: ZooKeeperServer | None = None   # the one whose log is read (an ensemble's leader)
    members: list[ZooKeeperServer] = field(default_factory=list)   # every ZooKeeper member

    def zxid(self) -> int:
        """The last transaction ZooKeeper committed (the leader's ``srvr``)."""
        assert self.zk is not None and self.zk.port is not None
        return txnlog.last_zxid(self.zk.host, self.zk.port)

    @property
    def zk_hosts(self) -> str:
        return hosts_of(self.members)

    def client_packets(self) -> tuple[int, int]:
        """What every member received from clients (requests, pings) and sent them
        (replies, watch events)."""
        counts = [txnlog.packets(member.host, member.port or 0) for member in self.members]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)


def start_server(name: str, args: argparse.Namespace, procs: Processes, work_dir: str,
                 stops: list[Callable[[], None]], root: str) -> Server:
    """``name``'s server (``zk``, ``redis``, ``redis-aof``, ``rabbitmq``, or the
    replicated ``zk3`` and ``rabbitmq3``; ``memory``:
    none, Celery's own ceiling), its stop
    pushed on ``stops`` first (so it is stopped even if it fails to start); zk's
    URLs under ``/{root}``, with ``--zk-option``."""
    if name == "zk":
        zk = measured_server(args)

        def stop_zk() -> None:
            close_sessions(zk.hosts)
            zk.close()
        stops.append(stop_zk)
        zk.start()
        return warmed_up(name, args, procs, work_dir, root, [zk], stop_zk)
    if name in ("zk3", "rabbitmq3"):
        return start_replicated(name, args, procs, work_dir, stops, root)
    if name == "memory":   # no server: the queues live in the worker's own process
        stops.append(nothing := lambda: None)
        return Server(name, "memory://", "", "Celery alone (kombu's memory transport)",
                      nothing, [])
    if name in ("redis", "redis-aof"):
        redis = RedisServer(procs, work_dir, durable=name == "redis-aof")

        def stop_redis() -> None:
            if redis.proc in procs.procs:
                procs.stop_and_remove(redis.proc)
        stops.append(stop_redis)
        redis.start()
        assert redis.proc is not None
        return Server(name, redis.url(0), redis.url(1), f"Redis {redis.version()}",
                      stop_redis, [redis.proc.pid])
    if name != "rabbitmq":
        raise ValueError(f"unknown broker {name!r}")
    rabbit = RabbitServer(procs, work_dir)
    stops.append(rabbit.stop)
    log("starting RabbitMQ")
    rabbit.start()
    assert rabbit.proc is not None
    return Server(name, rabbit.url(), "rpc://", f"RabbitMQ {rabbit.version()}", rabbit.stop,
                  [rabbit.proc.pid, rabbit.beam])


def warmed_up(name: str, args: argparse.Namespace, procs: Processes, work_dir: str,
              root: str, members: list[ZooKeeperServer], stop: Callable[[], None]) -> Server:
    """ZooKeeper started (one server, or an ensemble of ``members``), warmed up, as
    a :class:`Server` whose URLs are under ``/{root}``, with ``--zk-option``."""
    from .load import warm_up_with_load

    modes = {member: four_letter_word(member.host, member.port or 0, "srvr")
             for member in members}
    leader = next(member for member, srvr in modes.items()
                  if len(members) == 1 or "Mode: leader" in srvr)
    url = f"zk://{hosts_of(members)}"
    warm_up_zookeeper(hosts_of(members))
    query = "?" + "&".join(args.zk_option) if args.zk_option else ""
    warm_up_with_load(procs, work_dir, f"{url}/warm-up{query}", args.zk_warm_up)
    return Server(name, f"{url}/{root}{query}", f"{url}/{root}-results{query}",
                  modes[leader].splitlines()[0], stop,
                  [member.pid or 0 for member in members], leader, members)


def start_servers(args: argparse.Namespace, procs: Processes, work_dir: str,
                  stops: list[Callable[[], None]], root: str) -> dict[str, Server]:
    """Every server of ``args.brokers`` at once (:func:`start_server`)."""
    return {name: start_server(name, args, procs, work_dir, stops, root)
            for name in args.brokers}


def heap_used(pid: int) -> int:
    """A JVM's live heap after a full GC, bytes (jcmd)."""
    subprocess.run(["jcmd", str(pid), "GC.run"], capture_output=True, timeout=120)
    out = subprocess.run(["jcmd", str(pid), "GC.heap_info"], capture_output=True,
                         text=True, timeout=60).stdout
    for line in out.splitlines():
        if " used " in line and "total" in line:
            return int(line.split(" used ")[1].split("K")[0]) * 1024
    raise RuntimeError(f"no heap figure in: {out!r}")


# -- the production shape: members on hosts apart -------------------------------------
ZK_HOSTS = ("zk1", "zk2", "zk3")
RABBIT_HOSTS = ("rabbit1", "rabbit2", "rabbit3")

_network: Network | None = None


def hosts_apart(stops: list[Callable[[], None]]) -> Network:
    """The run's hosts, made at the first call; deleted when ``stops`` unwinds,
    after everything pushed on it."""
    global _network
    if _network is None:
        ensure_tools()
        lock = exclusive()
        remove_leftovers()
        net = Network([*ZK_HOSTS, *RABBIT_HOSTS])

        def delete() -> None:
            global _network
            net.destroy()
            lock.close()
            _network = None
        stops.insert(0, delete)
        net.create()
        _network = net
    return _network


def start_replicated(name: str, args: argparse.Namespace, procs: Processes, work_dir: str,
                     stops: list[Callable[[], None]], root: str) -> Server:
    """``zk3`` or ``rabbitmq3``, started; its stop pushed on ``stops`` first."""
    net = hosts_apart(stops)
    if name == "zk3":
        return start_ensemble(net, args, procs, work_dir, stops, root)
    return start_cluster(net, procs, work_dir, stops)


def start_ensemble(net: Network, args: argparse.Namespace, procs: Processes, work_dir: str,
                   stops: list[Callable[[], None]], root: str) -> Server:
    ensemble = ZooKeeperEnsemble(
        hosts=[net[host].address for host in ZK_HOSTS],
        command_prefixes=[net[host].exec_prefix() for host in ZK_HOSTS],
        data_dir=os.path.join(work_dir, "zk3"), **measured_settings(args))

    def stop() -> None:
        close_sessions(ensemble.hosts)
        ensemble.stop()
    stops.append(stop)
    log("starting a ZooKeeper ensemble of three")
    ensemble.start(timeout=120)
    return warmed_up("zk3", args, procs, work_dir, root, ensemble.members, stop)


def start_cluster(net: Network, procs: Processes, work_dir: str,
                  stops: list[Callable[[], None]]) -> Server:
    nodes = [RabbitServer(procs, work_dir, net[host]) for host in RABBIT_HOSTS]
    before = epmd_pids()

    def stop() -> None:
        for node in nodes:
            node.stop_node()
        stop_new_epmds(before)
    stops.append(stop)
    log("starting a RabbitMQ cluster of three")
    for node in nodes:
        node.spawn()
    for node in nodes:
        node.await_startup()
    first = nodes[0]
    for node in nodes[1:]:
        for step in (("stop_app",), ("join_cluster", first.node), ("start_app",)):
            done = node.run_ctl(*step, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{node.node}: rabbitmqctl {' '.join(step)} failed: "
                                   f"{done.stdout}{done.stderr}")
    running = first.ctl("eval", "length(rabbit_nodes:all_running()).").strip()
    if running != str(len(nodes)):
        raise RuntimeError(f"the RabbitMQ cluster runs {running} nodes, not {len(nodes)}: "
                           f"{first.ctl('cluster_status')}")
    pids = [pid for node in nodes for pid in (node.proc.pid if node.proc else 0, node.beam)]
    return Server("rabbitmq3", QUORUM + ";".join(node.url() for node in nodes), "rpc://",
                  f"RabbitMQ {first.version()}, a cluster of {len(nodes)}, quorum queues",
                  stop, pids)
