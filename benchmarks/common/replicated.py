"""The production shape: ZooKeeper's three-member ensemble and RabbitMQ's
three-node cluster with quorum queues, each member on a host of its own.

The hosts are network namespaces on one bridge (:mod:`common.net`), made at
the first replicated server a run starts and deleted at its end. Clients (the
workers, the script) stay on this host and reach the members over the bridge,
as clients on other machines would, with every member in their URL (kazoo
picks one at random; kombu takes the first and fails over to the next).

* ``zk3``: three members with ``zk``'s settings (ZooKeeper's defaults,
  ``forceSync``, production JVM flags), warmed up as ``zk`` is.
* ``rabbitmq3``: three nodes joined into one cluster; its URL
  (:data:`common.app.QUORUM`) makes Celery declare quorum queues
  (``task_default_queue_type``) and confirm every publish, the promise a
  replicated ZooKeeper makes. Results go by ``rpc://``.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from celery_zk.server import SERVER_JVM_FLAGS, ZooKeeperEnsemble

from .app import QUORUM
from .figures import log
from .net import Network, ensure_tools, exclusive, remove_leftovers
from .processes import Processes
from .servers import RabbitServer, Server, close_sessions, epmd_pids, stop_new_epmds, warmed_up

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
        data_dir=os.path.join(work_dir, "zk3"), tick_time=2000,
        extra_config={"forceSync": args.zk_force_sync},
        jvm_flags=(*SERVER_JVM_FLAGS, *args.zk_jvm_flag))

    def stop() -> None:
        close_sessions(ensemble.hosts)
        ensemble.stop()
    stops.append(stop)
    log("starting a ZooKeeper ensemble of three")
    ensemble.start(timeout=120)
    return warmed_up("zk3", args, procs, work_dir, root, ensemble.url, ensemble.members, stop)


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
