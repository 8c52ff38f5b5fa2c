"""What the benchmark scripts share: the processes they start and the figures they print.

Imported by the scripts in this directory (never run): the subprocesses of a
run (:class:`Processes`, each in its own process group, all stopped at the
end), the servers (the measured ZooKeeper and its options, ``redis-server``,
a private RabbitMQ node), ``celery -A bench_app worker`` processes
(:func:`spawn_worker`, :class:`Workers`), and the numbers: nearest-rank
percentiles, a rate over threads, tables, JSON files, log lines.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from celery_zk.server import SERVER_JVM_FLAGS, ZooKeeperServer, free_ports

HERE = os.path.dirname(os.path.abspath(__file__))
REDIS_SERVER = "/usr/bin/redis-server"
WARM_UP_SECONDS = 3.0


# -- figures and output -----------------------------------------------------------------
def log(msg: str, tag: str = "bench") -> None:
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile (p99 of 200 samples is the 198th smallest)."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))  # ceil
    return ordered[int(rank) - 1]


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def table(rows: list[list[str]]) -> list[str]:
    """Aligned columns, a rule under the first row; the first column left-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)


def pause() -> None:
    """20-50 ms between latency samples, so the receiving side is idle each time."""
    time.sleep(random.uniform(0.020, 0.050))


def sample(once: Callable[[], float], samples: int, warm_up: int = 5) -> list[float]:
    """Milliseconds of ``samples`` calls after ``warm_up`` uncounted ones (connections,
    queue declarations), each followed by a pause."""
    for _ in range(warm_up):
        once()
        pause()
    values = []
    for _ in range(samples):
        values.append(once() * 1000)
        pause()
    return values


def threaded_rate(call: Callable[[int], object], total: int, threads: int,
                  then: Callable[[], None] | None = None) -> float:
    """Calls per second: ``threads`` threads at once, each calling ``call(index)`` for
    ``index`` in ``range(total // threads)``; the clock runs from the first start until
    every thread has returned and ``then`` (if given) has too."""
    per = total // threads

    def run() -> None:
        for index in range(per):
            call(index)

    pool = [threading.Thread(target=run) for _ in range(threads)]
    t0 = time.perf_counter()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if then is not None:
        then()
    return per * threads / (time.perf_counter() - t0)


# -- processes ----------------------------------------------------------------------------
class Processes:
    """Every subprocess the benchmark started, each in its own process group."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, args: list[str], out_path: str, env: dict[str, str] | None = None,
              cwd: str | None = None) -> subprocess.Popen[bytes]:
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(args, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    @staticmethod
    def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM,
             grace: float = 15.0) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:  # the group: pool threads' children, anything left behind
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()

    def stop_and_remove(self, proc: subprocess.Popen[bytes]) -> None:
        self.stop(proc)
        self.procs.remove(proc)

    def stop_all(self) -> None:
        """Newest first, each given its grace before the next is signalled."""
        while self.procs:
            self.stop(self.procs.pop())

    def stop_together(self, grace: float = 15.0) -> None:
        """SIGTERM to every group at once, then each waited for (peers, e.g. workers)."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        while self.procs:
            self.stop(self.procs.pop(0), sig=0, grace=grace)   # signal 0: none more


def tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return ""


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, benchmarks/ first on PYTHONPATH (a child imports
    bench_app or affinity from there), and ``extra``."""
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))
    env.update(extra or {})
    return env


# -- servers -------------------------------------------------------------------------------
def add_server_options(parser: argparse.ArgumentParser) -> None:
    """The measured ZooKeeper's settings (bench.py, floor.py, request_cost.py, shapes.py,
    timeline.py)."""
    parser.add_argument("--zk-force-sync", choices=("yes", "no"), default="yes",
                        help="ZooKeeper's forceSync (fsync every write; default yes)")
    parser.add_argument("--zk-warm-up", type=float, default=30.0, metavar="SECONDS",
                        help="before measuring zk, run a worker under a steady load for "
                             "this long: the server's JIT compiles its request path "
                             "meanwhile, as a server running for days has (default 30)")
    parser.add_argument("--zk-jvm-flag", action="append", default=[], metavar="FLAG",
                        help="extra JVM flag for the ZooKeeper server, repeatable, e.g. "
                             "-Dzookeeper.commitProcessor.numWorkerThreads=0")


def add_zk_option(parser: argparse.ArgumentParser) -> None:
    """``--zk-option KEY=VALUE``: a celery_zk option in the zk URLs (bench.py, shapes.py)."""
    parser.add_argument("--zk-option", action="append", default=[], metavar="KEY=VALUE",
                        help="celery_zk option for the zk broker and backend URLs, repeatable, "
                             "e.g. persistent_watches=false")


def measured_server(args: argparse.Namespace) -> ZooKeeperServer:
    """A production-like server: full JIT, default GC, ZooKeeper's default tickTime."""
    return ZooKeeperServer(extra_config={"forceSync": args.zk_force_sync},
                           jvm_flags=(*SERVER_JVM_FLAGS, *args.zk_jvm_flag), tick_time=2000)


def warm_up_zookeeper(hosts: str) -> None:
    """A few seconds of the writes and reads the brokers do, so the JVM has loaded
    and compiled its request path before the first measurement (else whichever
    ZooKeeper transport is measured first pays for it)."""
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
    rabbitmq, so its directories are that user's)."""

    def __init__(self, procs: Processes, work_dir: str) -> None:
        if shutil.which("rabbitmq-server") is None:
            raise RuntimeError("rabbitmq-server not found: install Debian's package "
                               "(apt-get install rabbitmq-server), or leave rabbitmq out "
                               "with --brokers")
        self.procs = procs
        self.port, dist = free_ports(2)
        self.node = f"scale{self.port}@localhost"
        self.base = os.path.join(work_dir, "rabbitmq")
        os.chmod(work_dir, 0o755)   # mkdtemp's 0700 would keep user rabbitmq out
        os.makedirs(os.path.join(self.base, "log"))
        open(os.path.join(self.base, "enabled_plugins"), "w").write("[].")
        shutil.chown(self.base, "rabbitmq", "rabbitmq")
        for name in os.listdir(self.base):
            shutil.chown(os.path.join(self.base, name), "rabbitmq", "rabbitmq")
        self.env = dict(os.environ, RABBITMQ_NODE_PORT=str(self.port),
                        RABBITMQ_NODENAME=self.node, RABBITMQ_DIST_PORT=str(dist),
                        RABBITMQ_MNESIA_BASE=os.path.join(self.base, "mnesia"),
                        RABBITMQ_LOG_BASE=os.path.join(self.base, "log"),
                        RABBITMQ_ENABLED_PLUGINS_FILE=os.path.join(self.base, "enabled_plugins"),
                        RABBITMQ_FEATURE_FLAGS_FILE=os.path.join(self.base, "feature_flags"))
        self.out = os.path.join(work_dir, "rabbitmq.out")
        self.proc: subprocess.Popen[bytes] | None = None
        self.beam = 0   # the node's OS pid
        self.epmd_before: set[int] = set()

    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def ctl(self, *args: str, timeout: float = 60) -> str:
        return subprocess.run(["rabbitmqctl", "-n", self.node, *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout).stdout

    def start(self) -> RabbitServer:
        self.epmd_before = epmd_pids()
        self.proc = self.procs.spawn(["rabbitmq-server"], self.out, self.env)
        deadline = time.monotonic() + 120
        while True:   # await_startup fails at once until the node is known to epmd
            result = subprocess.run(["rabbitmqctl", "-n", self.node, "await_startup",
                                     "--timeout", "10"], env=self.env, capture_output=True,
                                    text=True)
            if result.returncode == 0:
                self.beam = int(self.ctl("eval", "os:getpid().").strip().strip('"'))
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"RabbitMQ did not start:\n{tail(self.out)}\n"
                                   f"{result.stdout}{result.stderr}")
            time.sleep(1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            subprocess.run(["rabbitmqctl", "-n", self.node, "stop"], env=self.env,
                           capture_output=True, timeout=60)
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
        # The node starts epmd for the whole host (a daemon: not our child): stop
        # the ones that were not running before we started, by pid.
        for pid in epmd_pids() - self.epmd_before:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def version(self) -> str:
        return self.ctl("version").strip()

    def memory(self) -> int:
        """Bytes the node uses (its own total, as `rabbitmqctl status` reports)."""
        out = self.ctl("eval", "erlang:memory(total).")
        return int(out.strip().rstrip("."))


def epmd_pids() -> set[int]:
    found = subprocess.run(["pgrep", "-x", "epmd"], capture_output=True, text=True).stdout
    return {int(pid) for pid in found.split()}


def start_brokers(args: argparse.Namespace, procs: Processes, work_dir: str,
                  stack: list[Callable[[], None]], root: str
                  ) -> tuple[dict[str, tuple[str, str]], ZooKeeperServer | None]:
    """Broker and result backend URLs of each of ``args.brokers``, its server started:
    ``zk`` (:func:`measured_server`, warmed up, ``--zk-option`` in its URLs, under
    ``/{root}``), ``redis`` and ``redis-aof`` (:class:`RedisServer`, results in db
    1), ``rabbitmq`` (:class:`RabbitServer`, ``rpc://`` results); and the
    ZooKeeper server, if any. What must be stopped by hand is pushed on
    ``stack``; the rest are ``procs``'."""
    urls: dict[str, tuple[str, str]] = {}
    zk = None
    if "zk" in args.brokers:
        zk = measured_server(args)
        zk.start()
        stack.append(zk.close)
        warm_up_zookeeper(zk.hosts)
        query = "?" + "&".join(args.zk_option) if args.zk_option else ""
        urls["zk"] = (f"{zk.url}/{root}{query}", f"{zk.url}/{root}-results{query}")
    for name, durable in (("redis", False), ("redis-aof", True)):
        if name in args.brokers:
            redis = RedisServer(procs, work_dir, durable=durable).start()
            urls[name] = (redis.url(0), redis.url(1))
    if "rabbitmq" in args.brokers:
        rabbit = RabbitServer(procs, work_dir)
        stack.append(rabbit.stop)
        log("starting RabbitMQ")
        rabbit.start()
        urls["rabbitmq"] = (rabbit.url(), "rpc://")
    return urls, zk


def heap_used(pid: int) -> int:
    """A JVM's live heap after a full GC, bytes (jcmd)."""
    subprocess.run(["jcmd", str(pid), "GC.run"], capture_output=True, timeout=120)
    out = subprocess.run(["jcmd", str(pid), "GC.heap_info"], capture_output=True,
                         text=True, timeout=60).stdout
    for line in out.splitlines():
        if " used " in line and "total" in line:
            return int(line.split(" used ")[1].split("K")[0]) * 1024
    raise RuntimeError(f"no heap figure in: {out!r}")


@contextmanager
def bench_run(prefix: str, keep: bool = False
              ) -> Iterator[tuple[Processes, str, list[Callable[[], None]]]]:
    """A run's processes, work directory and stack of things to stop: everything
    stopped at the end (also after an error or Ctrl-C), the directory removed
    unless ``keep``."""
    work_dir = tempfile.mkdtemp(prefix=prefix)
    procs = Processes()
    stack: list[Callable[[], None]] = []
    try:
        yield procs, work_dir, stack
    finally:
        procs.stop_all()
        for stop in reversed(stack):
            stop()
        if keep:
            log(f"work dir kept: {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)


# -- workers ---------------------------------------------------------------------------------
def announce_ready(variable: str) -> None:
    """Once this process's worker consumes (``worker_ready``), write its pid to the
    file the environment ``variable`` names: at loglevel WARNING a worker prints no
    "ready." line to wait for."""
    from celery.signals import worker_ready

    def write(**_: Any) -> None:
        path = os.environ.get(variable)
        if path:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(str(os.getpid()))
    worker_ready.connect(write, weak=False)


def spawn_worker(procs: Processes, work_dir: str, name: str, broker: str, queue: str,
                 backend: str | None = None, env: dict[str, str] | None = None,
                 pool: str = "threads", concurrency: int = 4,
                 wait: bool = True) -> subprocess.Popen[bytes]:
    """Start ``celery -A bench_app worker`` on ``queue`` (output in ``{name}.out``);
    with ``wait``, return once it consumes (bench_app's ready file)."""
    ready = os.path.join(work_dir, f"{name}.ready")
    out = os.path.join(work_dir, f"{name}.out")
    args = [sys.executable, "-m", "celery", "-A", "bench_app", "worker",
            f"--pool={pool}", "-c", str(concurrency), "--loglevel=WARNING",
            f"--hostname={name}@%h", "-Q", queue,
            "--without-mingle", "--without-gossip", "--without-heartbeat"]
    proc = procs.spawn(args, out, child_env({"BENCH_BROKER": broker,
                                             "BENCH_BACKEND": backend or "",
                                             "BENCH_READY_FILE": ready, **(env or {})}))
    if wait:
        deadline = time.monotonic() + 60
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                procs.stop_and_remove(proc)
                raise RuntimeError(f"worker for {broker} did not become ready "
                                   f"(exit {proc.poll()}):\n{tail(out)}")
            time.sleep(0.02)
    return proc


class Workers:
    """The ``celery -A bench_app worker`` processes of one run, named ``{prefix}{n}``,
    each running for one ``with`` block."""

    def __init__(self, procs: Processes, work_dir: str, prefix: str = "bench") -> None:
        self.procs, self.work_dir, self.prefix = procs, work_dir, prefix
        self.started = 0

    @contextmanager
    def worker(self, broker: str, queue: str, backend: str | None = None,
               env: dict[str, str] | None = None, wait: bool = True, pool: str = "threads"
               ) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
        """A worker on ``queue``; yields (process, time.time() at spawn)."""
        self.started += 1
        name = f"{self.prefix}{self.started}"
        spawned = time.time()
        proc = spawn_worker(self.procs, self.work_dir, name, broker, queue, backend=backend,
                            env=env, pool=pool, wait=wait)
        try:
            yield proc, spawned
            if proc.poll() is not None:
                out = os.path.join(self.work_dir, f"{name}.out")
                raise RuntimeError(f"worker exited early ({proc.returncode}):\n{tail(out)}")
        finally:
            self.procs.stop_and_remove(proc)

    def drain(self, broker: str, queue: str, total: int, timeout: float, label: str,
              poll: float = 0.02) -> tuple[dict[str, Any], float]:
        """A worker started on ``queue`` runs ``total`` distinct ``bench.drain`` tasks
        (a backlog already there, or arriving); returns bench_app's report (first,
        last, elapsed, distinct, executions) and time.time() at the worker's spawn."""
        done = os.path.join(self.work_dir, f"{self.prefix}{self.started + 1}.drain.json")
        env = {"BENCH_DRAIN_TOTAL": str(total), "BENCH_DRAIN_FILE": done}
        with self.worker(broker, queue, env=env, wait=False) as (proc, spawned):
            deadline = time.monotonic() + timeout
            while not os.path.exists(done):
                if proc.poll() is not None:
                    raise RuntimeError(f"{label}: drain worker exited ({proc.returncode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{label}: {total} tasks not drained in {timeout:.0f}s")
                time.sleep(poll)
        with open(done, encoding="utf-8") as fh:
            return json.load(fh), spawned
