"""Scale and longevity: big backlogs, server memory, restarts, many queues.

One run starts its own ZooKeeper (celery_zk's launcher, default settings, a
heap big enough for the backlog), ``redis-server`` (no persistence) and a
private RabbitMQ node on free ports, measures each with real ``celery
worker`` processes and stops everything it started, also on Ctrl-C.

(backlog)    drain rate of one 4-thread worker over the first ``--window``
             tasks of a ``--backlog`` (1,000,000) backlog against a whole
             5,000 backlog, the ``apply_async`` rate of one client into an
             empty queue and on top of the big backlog, and the purge of
             what is left. The big backlog is filled by 4 publisher
             processes (zk: ``confirm_publish=false``, i.e. pipelined).
(memory)     server memory per waiting message at the big backlog: ZooKeeper
             ``mntr`` data size and JVM heap after a GC, Redis
             ``used_memory``, RabbitMQ's queue memory.
(restart)    zk: seconds until ZooKeeper serves again after a restart with the
             big backlog stored (and that every message is still there),
             then a ``--restart-backlog`` (100,000) backlog drained after a
             restart: each message executed exactly once.
(queues)     zk: one worker consuming ``--queues`` (1,000) queues: start-up
             time, watches held (``wchs``), CPU of worker and server idle.

How throughput grows with the worker processes on one queue is
``workers.py``'s question.

Usage::

    .venv/bin/python benchmarks/scale.py [--quick] [--brokers zk,redis,rabbitmq]
        [--only backlog,restart,queues] [--backlog N] [--json out.json]
"""
from __future__ import annotations

import argparse
import multiprocessing
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from common.app import DRAIN, make_app, waiting
from common.figures import log, write_json
from common.machine import cpu_seconds
from common.processes import Processes
from common.servers import RabbitServer, RedisServer, choose, heap_used
from common.worker import Workers, spawn_worker
from kombu import Connection

from celery_zk.server import SERVER_JVM_FLAGS, ZooKeeperServer, four_letter_word

BROKERS = ("zk", "redis", "rabbitmq")
PARTS = ("backlog", "restart", "queues")
QUEUE = "scale"
FILLERS = 4
SMALL = 5_000


# -- servers ---------------------------------------------------------------------------
def zk_server(heap: str) -> ZooKeeperServer:
    # The launcher's production flags say -Xmx512m; the later -Xmx wins.
    return ZooKeeperServer(jvm_flags=(*SERVER_JVM_FLAGS, f"-Xms{heap}", f"-Xmx{heap}"),
                           tick_time=2000)


def mntr(server: ZooKeeperServer) -> dict[str, str]:
    assert server.port is not None
    reply = four_letter_word(server.host, server.port, "mntr", timeout=10)
    return dict(line.split("\t", 1) for line in reply.splitlines() if "\t" in line)


# -- publishing and counting -----------------------------------------------------------
def _fill_part(broker: str, start: int, stop: int) -> None:
    app = make_app(broker)
    if broker.startswith("zk"):
        app.conf.broker_transport_options = {"confirm_publish": False}
    task = app.tasks[DRAIN]
    with app.producer_or_acquire() as producer:
        for index in range(start, stop):
            task.apply_async((index,), queue=QUEUE, producer=producer)
    app.close()   # an unconfirmed publisher waits for its replies here


def fill(broker: str, start: int, count: int) -> float:
    """Publish ``count`` drain tasks from FILLERS processes; messages/s."""
    began = time.monotonic()
    step = -(-count // FILLERS)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_fill_part, args=(broker, low, min(low + step, start + count)))
             for low in range(start, start + count, step)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"a publisher process failed ({proc.exitcode})")
    return count / (time.monotonic() - began)


def publish_rate(broker: str, start: int, count: int) -> float:
    """``apply_async`` from one client, confirmed (the default); messages/s."""
    app = make_app(broker)
    task = app.tasks[DRAIN]
    try:
        with app.producer_or_acquire() as producer:
            task.apply_async((start,), queue=QUEUE, producer=producer)   # connect first
            began = time.monotonic()
            for index in range(start + 1, start + count):
                task.apply_async((index,), queue=QUEUE, producer=producer)
            return (count - 1) / (time.monotonic() - began)
    finally:
        app.close()


def wait_for(check: Callable[[], bool], timeout: float, what: str, step: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(step)


class Run:
    def __init__(self, args: argparse.Namespace, work_dir: str) -> None:
        self.args = args
        self.work_dir = work_dir
        self.procs = Processes()
        self.workers = Workers(self.procs, work_dir, "w")
        self.results: dict[str, dict[str, Any]] = {}
        self.zk: ZooKeeperServer   # set while zk is measured

    def drain(self, broker: str, total: int, timeout: float) -> dict[str, Any]:
        """One 4-thread worker runs ``total`` drain tasks; common.app's report."""
        result = self.workers.drain(broker, QUEUE, total, timeout, broker)
        result["rate"] = total / result["elapsed"]
        return result

    # -- (backlog) and (memory) --------------------------------------------------------
    def backlog(self, name: str, broker: str, memory: Callable[[], dict[str, float]]
                ) -> dict[str, Any]:
        args, out = self.args, self.results.setdefault(name, {})
        log(f"{name}: publish {SMALL:,} into an empty queue, drain them")
        out["publish_rate_empty"] = publish_rate(broker, 0, SMALL)
        out["drain_small"] = self.drain(broker, SMALL, 600)["rate"]
        before = memory()
        log(f"{name}: fill a {args.backlog:,} backlog ({FILLERS} publishers)")
        out["fill_rate"] = fill(broker, 10_000_000, args.backlog)
        out["publish_rate_big"] = publish_rate(broker, 20_000_000, SMALL)
        stored = waiting(broker, QUEUE)
        out["stored"] = stored
        after = memory()
        out["memory_per_message"] = {k: (after[k] - before[k]) / stored for k in after}
        out["memory"] = after
        if name == "zk" and "restart" in args.only:
            self.restart_with_backlog(out, broker, stored)
        log(f"{name}: drain {args.window:,} of the {stored:,} backlog")
        out["drain_big"] = self.drain(broker, args.window, 3600)["rate"]
        out["drain_ratio"] = out["drain_big"] / out["drain_small"]
        began = time.monotonic()
        with Connection(broker) as conn:
            out["purged"] = conn.default_channel.queue_purge(QUEUE)
        out["purge_seconds"] = time.monotonic() - began
        log(f"{name}: {out}")
        return out

    def restart_with_backlog(self, out: dict[str, Any], broker: str, stored: int) -> None:
        zk = self.zk
        log(f"zk: restart ZooKeeper with {stored:,} messages stored")
        zk.stop()
        began = time.monotonic()
        zk.spawn()
        wait_for(zk.serving, 3600, "ZooKeeper to serve again", 0.05)
        out["restart_seconds"] = time.monotonic() - began
        out["stored_after_restart"] = waiting(broker, QUEUE)
        out["first_request_seconds"] = time.monotonic() - began

    # -- (restart): exactly once after a restart -----------------------------------------
    def restart_exactly_once(self, broker: str) -> None:
        count, out = self.args.restart_backlog, self.results.setdefault("zk", {})
        log(f"zk: fill {count:,}, restart ZooKeeper, drain them all")
        fill(broker, 30_000_000, count)
        self.zk.stop()
        began = time.monotonic()
        self.zk.spawn()
        wait_for(self.zk.serving, 600, "ZooKeeper to serve again", 0.05)
        out["restart_small_seconds"] = time.monotonic() - began
        report = self.drain(broker, count, 3600)
        time.sleep(2)   # a duplicate would still be running now
        out["exactly_once"] = {"distinct": report["distinct"],
                               "executions": report["executions"],
                               "left_waiting": waiting(broker, QUEUE), "published": count}
        log(f"zk: after restart {out['exactly_once']}")

    # -- (queues) ------------------------------------------------------------------------
    def many_queues(self, broker: str) -> None:
        count, out = self.args.queues, self.results.setdefault("zk", {})
        names = ",".join(f"q{i}" for i in range(count))
        watches_before = mntr(self.zk).get("zk_watch_count", "0")
        began = time.monotonic()
        worker = spawn_worker(self.procs, self.work_dir, "queues", broker, names)
        out["queues"] = count
        out["queues_startup_seconds"] = time.monotonic() - began
        time.sleep(5)   # settle: offers, watches
        assert self.zk.pid is not None and self.zk.port is not None
        wchs = four_letter_word(self.zk.host, self.zk.port, "wchs", timeout=10)
        cpu = (cpu_seconds([worker.pid]), cpu_seconds([self.zk.pid]))
        time.sleep(self.args.idle)
        out["queues_idle_cpu_percent"] = {
            "worker": 100 * (cpu_seconds([worker.pid]) - cpu[0]) / self.args.idle,
            "zookeeper": 100 * (cpu_seconds([self.zk.pid]) - cpu[1]) / self.args.idle}
        out["queues_watches"] = {"wchs": " ".join(wchs.split()), "before": watches_before,
                                 "zk_watch_count": mntr(self.zk).get("zk_watch_count")}
        self.procs.stop_and_remove(worker)
        log(f"zk: {count} queues: {out['queues_startup_seconds']:.1f}s to start, "
            f"idle CPU {out['queues_idle_cpu_percent']}, {out['queues_watches']}")


def render(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = ["", f"backlog {args.backlog:,}, window {args.window:,}; small backlog {SMALL:,}",
             ""]
    head = (f"{'broker':<9} {'drain 5k/s':>10} {'drain big/s':>11} {'ratio':>6} "
            f"{'pub empty/s':>11} {'pub big/s':>9} {'fill/s':>7} {'purge s':>8}")
    lines += [head, "-" * len(head)]
    for name, out in results.items():
        if "drain_small" not in out:
            continue
        lines.append(f"{name:<9} {out['drain_small']:>10,.0f} {out['drain_big']:>11,.0f} "
                     f"{out['drain_ratio']:>6.2f} {out['publish_rate_empty']:>11,.0f} "
                     f"{out['publish_rate_big']:>9,.0f} {out['fill_rate']:>7,.0f} "
                     f"{out['purge_seconds']:>8.1f}")
    lines.append("")
    for name, out in results.items():
        if "memory_per_message" in out:
            per = ", ".join(f"{k} {v:,.0f} B" for k, v in out["memory_per_message"].items())
            lines.append(f"{name}: memory per waiting message: {per}")
    zk = results.get("zk", {})
    for key in ("restart_seconds", "stored_after_restart", "restart_small_seconds",
                "exactly_once", "queues", "queues_startup_seconds", "queues_watches",
                "queues_idle_cpu_percent"):
        if key in zk:
            lines.append(f"zk: {key}: {zk[key]}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default=",".join(BROKERS))
    parser.add_argument("--only", default=",".join(PARTS))
    parser.add_argument("--backlog", type=int, default=1_000_000)
    parser.add_argument("--window", type=int, default=50_000)
    parser.add_argument("--restart-backlog", type=int, default=100_000)
    parser.add_argument("--queues", type=int, default=1_000)
    parser.add_argument("--idle", type=float, default=30.0, help="seconds of idle CPU")
    parser.add_argument("--zk-heap", default="6g")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes: a smoke run of every part")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.quick:
        args.backlog, args.window, args.restart_backlog = 20_000, 5_000, 2_000
        args.queues, args.idle, args.zk_heap = 50, 5.0, "1g"
    args.brokers = choose(parser, args.brokers, BROKERS)
    args.only = choose(parser, args.only, PARTS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work_dir = tempfile.mkdtemp(prefix="celery-zk-scale-")
    run = Run(args, work_dir)
    servers: list[Any] = []
    try:
        for name in args.brokers:
            if name == "zk":
                run.zk = server = zk_server(args.zk_heap).start()
                servers.append(server)
                broker = f"zk://{server.hosts}/scale"

                def memory(server: ZooKeeperServer = server) -> dict[str, float]:
                    assert server.pid is not None
                    return {"data": float(mntr(server)["zk_approximate_data_size"]),
                            "heap": float(heap_used(server.pid))}
            elif name == "redis":
                redis_server = RedisServer(run.procs, work_dir).start()
                broker = redis_server.url()

                def memory(server: RedisServer = redis_server) -> dict[str, float]:
                    import redis
                    return {"used_memory": float(
                        redis.Redis(port=server.port).info("memory")["used_memory"])}
            else:
                rabbit = RabbitServer(run.procs, work_dir)
                servers.append(rabbit)   # stopped even if it fails to start
                rabbit.start()
                broker = rabbit.url()

                def memory(server: RabbitServer = rabbit) -> dict[str, float]:
                    return {"node_total": float(server.memory())}
            if "backlog" in args.only:
                run.backlog(name, broker, memory)
            if name == "zk" and "restart" in args.only:
                run.restart_exactly_once(broker)
            if name == "zk" and "queues" in args.only:
                run.many_queues(broker)
            for server in servers:
                getattr(server, "close", server.stop)()   # close: removes its data too
            servers.clear()
            run.procs.stop_all()
    finally:
        for server in servers:
            getattr(server, "close", server.stop)()
        run.procs.stop_all()
        shutil.rmtree(work_dir, ignore_errors=True)
    print(render(run.results, args))
    if args.json:
        write_json(args.json, {"args": vars(args), "results": run.results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
