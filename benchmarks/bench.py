"""Benchmark celery_zk against Redis and kombu's built-in ``zookeeper://``.

One run starts its own ZooKeeper (celery_zk's launcher) and ``redis-server``
on free ports, measures each broker with real ``celery worker`` processes
(threads pool, ``-c 4``) and stops everything it started, also on Ctrl-C.

Measurements (see benchmarks/README.md for what each one means):

(a) idle-worker round trip: one task at a time; the task publishes a reply
    on the same broker and the client waits for it (p50/p99, ms).
(b) drain: a backlog published while no worker runs, then drained by one
    4-thread worker (tasks/s, first to last task executed).
(c) publish: ``apply_async`` from one client, no worker (msgs/s).
(d) result round trip: ``delay(...).get()`` with celery_zk's result backend
    vs Celery's redis backend (only when ``celery_zk.backend`` is usable).
(e) floor: the bare ZooKeeper requests of (a) and (d) between two plain
    kazoo processes, no Celery (``floor.py``); a lower bound for (a) and (d).

Usage::

    .venv/bin/python benchmarks/bench.py [--quick] [--only zk,redis,kombu-zk]
        [--tasks 5000] [--latency-samples 200] [--zk-force-sync yes|no] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import celery  # noqa: E402
import kazoo  # noqa: E402
import kombu  # noqa: E402
from bench_app import ADD, DRAIN, ECHO, make_app  # noqa: E402
from floor import measure as measure_floor  # noqa: E402
from kombu import Connection, Queue  # noqa: E402

import celery_zk  # noqa: E402,F401  (registers zk://)
from celery_zk.server import (  # noqa: E402
    SERVER_JVM_FLAGS,
    ZooKeeperServer,
    four_letter_word,
    free_ports,
)

BROKERS = ("zk", "redis", "kombu-zk")
FLOOR = "zk-floor"   # the row of (e): bare ZooKeeper requests, no Celery
UNCONFIRMED = "zk-unconfirmed"   # (c) again with confirm_publish=false (an opt-in)
REDIS_SERVER = "/usr/bin/redis-server"
REDIS_HELP = ("redis-server not found at /usr/bin/redis-server. Install Debian's package "
              "(sudo apt-get install redis-server){dev}, then run the benchmark again.")

#: kombu's zookeeper transport polls every second (polling_interval=1), so a
#: round trip takes ~1-2 s and its drain is slow: it gets smaller defaults.
KOMBU_ZK_LATENCY_SAMPLES = 30
KOMBU_ZK_DRAIN_BUDGET = 60.0   # seconds the kombu-zk drain should take at most

PUBLISH_ROUNDS = 4   # even: see the alternating order in run()
WARM_UP_SECONDS = 3.0

TARGETS = [
    # key, numerator, denominator, op, bound, description
    ("latency_p50", "zk", "redis", "<=", 2.0, "round-trip p50: zk / redis"),
    ("drain_rate", "zk", "redis", ">=", 1.0, "drain rate: zk / redis"),
    ("publish_rate", "zk", "kombu-zk", ">=", 1.0, "publish rate: zk / kombu-zk"),
    ("result_p50", "zk", "redis", "<=", 2.0, "result round-trip p50: zk / redis"),
]
#: Targets a floor (e) bounds from below: the floor's ratio to the same denominator.
FLOOR_OF = {"latency_p50": "handoff", "result_p50": "result-handoff"}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile (p99 of 200 samples is the 198th smallest)."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))  # ceil
    return ordered[int(rank) - 1]


def verdict(value: float, op: str, bound: float) -> str:
    ok = value <= bound if op == "<=" else value >= bound
    return "PASS" if ok else "MISS"


# -- processes ------------------------------------------------------------------------
class Processes:
    """Every subprocess the benchmark started, each in its own process group."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, args: list[str], out_path: str, env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
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

    def stop_all(self) -> None:
        while self.procs:
            self.stop(self.procs.pop())


def tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return ""


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


def spawn_worker(procs: Processes, work_dir: str, name: str, broker: str, queue: str,
                 backend: str | None = None, env: dict[str, str] | None = None,
                 pool: str = "threads", concurrency: int = 4,
                 wait: bool = True) -> subprocess.Popen[bytes]:
    """Start ``celery -A bench_app worker`` on ``queue`` (output in ``{name}.out``);
    with ``wait``, return once it consumes (bench_app's ready file)."""
    ready = os.path.join(work_dir, f"{name}.ready")
    out = os.path.join(work_dir, f"{name}.out")
    full_env = dict(os.environ)
    full_env.update({
        "BENCH_BROKER": broker, "BENCH_BACKEND": backend or "",
        "BENCH_READY_FILE": ready,
        "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])),
    })
    full_env.update(env or {})
    args = [sys.executable, "-m", "celery", "-A", "bench_app", "worker",
            f"--pool={pool}", "-c", str(concurrency), "--loglevel=WARNING",
            f"--hostname={name}@%h", "-Q", queue,
            "--without-mingle", "--without-gossip", "--without-heartbeat"]
    proc = procs.spawn(args, out, full_env)
    if wait:
        deadline = time.monotonic() + 60
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                procs.stop(proc)
                procs.procs.remove(proc)
                raise RuntimeError(f"worker for {broker} did not become ready "
                                   f"(exit {proc.poll()}):\n{tail(out)}")
            time.sleep(0.02)
    return proc


@dataclass
class Bench:
    """Shared state of one run: servers, work dir, options, results."""

    args: argparse.Namespace
    procs: Processes
    work_dir: str
    urls: dict[str, str] = field(default_factory=dict)
    backends: dict[str, str] = field(default_factory=dict)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    _workers: int = 0

    # -- workers --------------------------------------------------------------------
    @contextmanager
    def worker(self, broker: str, queue: str, backend: str | None = None,
               env: dict[str, str] | None = None, wait: bool = True
               ) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
        """A ``celery worker`` on ``queue``; yields (process, time.time() at spawn)."""
        self._workers += 1
        name = f"bench{self._workers}"
        spawned = time.time()
        proc = spawn_worker(self.procs, self.work_dir, name, broker, queue, backend=backend,
                            env=env, wait=wait)
        try:
            yield proc, spawned
            if proc.poll() is not None:
                out = os.path.join(self.work_dir, f"{name}.out")
                raise RuntimeError(f"worker exited early ({proc.returncode}):\n{tail(out)}")
        finally:
            self.procs.stop(proc)
            self.procs.procs.remove(proc)

    def pause(self) -> None:
        time.sleep(random.uniform(0.020, 0.050))

    # -- (a) round trip over the broker alone ----------------------------------------
    def latency(self, name: str, samples: int) -> dict[str, Any]:
        url = self.urls[name]
        run = uuid.uuid4().hex[:8]
        queue, reply = f"bench-lat-{run}", f"bench-reply-{run}"
        app = make_app(url)
        echo = app.tasks[ECHO]
        got: list[str] = []

        def on_reply(body: dict[str, str], message: Any) -> None:
            got.append(body["token"])  # the sample ends here; the ack is not timed
            message.ack()

        with Connection(url) as conn, self.worker(url, queue):
            reply_queue = Queue(reply, routing_key=reply, durable=False)
            with conn.Consumer(reply_queue, accept=["json"], callbacks=[on_reply]):
                def once() -> float:
                    token = uuid.uuid4().hex
                    t0 = time.perf_counter()
                    echo.apply_async((reply, token), queue=queue)
                    deadline = time.monotonic() + 30
                    while token not in got:
                        conn.drain_events(timeout=max(0.01, deadline - time.monotonic()))
                    elapsed = time.perf_counter() - t0
                    got.clear()
                    return elapsed * 1000

                for _ in range(5):  # warm-up: connections, queue declarations
                    once()
                    self.pause()
                values = []
                for _ in range(samples):
                    values.append(once())
                    self.pause()
        app.close()
        return {"latency_p50": percentile(values, 50), "latency_p99": percentile(values, 99),
                "latency_mean": statistics.fmean(values), "latency_samples": samples}

    # -- (b) backlog drain -------------------------------------------------------------
    def drain(self, name: str, total: int) -> dict[str, Any]:
        url = self.urls[name]
        queue = f"bench-drain-{uuid.uuid4().hex[:8]}"
        done = os.path.join(self.work_dir, f"{queue}.json")
        app = make_app(url)
        task = app.tasks[DRAIN]
        task.apply_async((-1,), queue=queue)  # declares the queue; not counted
        t0 = time.perf_counter()
        for index in range(total - 1):
            task.apply_async((index,), queue=queue)
        backlog_publish = (total - 1) / (time.perf_counter() - t0)
        app.close()
        budget = max(120.0, total / 20)
        env = {"BENCH_DRAIN_TOTAL": str(total), "BENCH_DRAIN_FILE": done}
        with self.worker(url, queue, env=env, wait=False) as (proc, spawned):
            deadline = time.monotonic() + budget
            while not os.path.exists(done):
                if proc.poll() is not None:
                    raise RuntimeError(f"drain worker exited ({proc.returncode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: backlog of {total} not drained in {budget}s")
                time.sleep(0.02)
        with open(done, encoding="utf-8") as fh:
            report = json.load(fh)
        return {
            "drain_rate": total / report["elapsed"],
            "drain_rate_incl_startup": total / (report["last"] - spawned),
            "drain_tasks": total, "drain_seconds": report["elapsed"],
            "drain_duplicates": report["executions"] - report["distinct"],
            "backlog_publish_rate": backlog_publish,
        }

    # -- (c) publish ---------------------------------------------------------------------
    def publish(self, name: str, count: int) -> dict[str, Any]:
        url = self.urls[name]
        queue = f"bench-pub-{uuid.uuid4().hex[:8]}"
        app = make_app(url)
        task = app.tasks[DRAIN]
        task.apply_async((-1,), queue=queue)  # warm-up: connection, queue declaration
        t0 = time.perf_counter()
        for index in range(count):
            task.apply_async((index,), queue=queue)
        if name == UNCONFIRMED:
            app.close()  # waits until ZooKeeper stored every message: that time counts
        elapsed = time.perf_counter() - t0
        app.close()
        return {"publish_rate": count / elapsed, "publish_count": count}

    # -- (d) result round trip -------------------------------------------------------------
    def result(self, name: str, samples: int) -> dict[str, Any]:
        url, backend = self.urls[name], self.backends[name]
        queue = f"bench-res-{uuid.uuid4().hex[:8]}"
        app = make_app(url, backend)
        add = app.tasks[ADD]
        with self.worker(url, queue, backend=backend):
            for _ in range(5):
                add.apply_async((1, 2), queue=queue).get(timeout=30)
                self.pause()
            values = []
            for i in range(samples):
                t0 = time.perf_counter()
                result = add.apply_async((i, 1), queue=queue)
                value = result.get(timeout=30)
                values.append((time.perf_counter() - t0) * 1000)
                if value != i + 1:
                    raise RuntimeError(f"{name}: add({i}, 1) returned {value!r}")
                result.forget()
                self.pause()
        app.close()
        return {"result_p50": percentile(values, 50), "result_p99": percentile(values, 99),
                "result_samples": samples}


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """The measured ZooKeeper's settings (bench.py, floor.py, request_cost.py)."""
    parser.add_argument("--zk-force-sync", choices=("yes", "no"), default="yes",
                        help="ZooKeeper's forceSync (fsync every write; default yes)")
    parser.add_argument("--zk-jvm-flag", action="append", default=[], metavar="FLAG",
                        help="extra JVM flag for the ZooKeeper server, repeatable, e.g. "
                             "-Dzookeeper.commitProcessor.numWorkerThreads=0")


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


# -- reporting -------------------------------------------------------------------------
def backend_available() -> str | None:
    """None if celery_zk's result backend resolves, else why not."""
    try:
        from celery import Celery

        import celery_zk.backend  # noqa: F401
        backend = Celery(result_backend="zk://127.0.0.1:1/x", set_as_current=False).backend
        if type(backend).__module__ != "celery_zk.backend":
            return f"zk:// resolved to {type(backend).__module__}"
    except Exception as exc:  # any failure means: not ready yet
        return f"{type(exc).__name__}: {exc}"
    return None


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def render(results: dict[str, dict[str, Any]], info: dict[str, Any],
           notes: list[str]) -> tuple[str, list[dict[str, Any]]]:
    cols: list[tuple[str, str]] = [
            ("broker", ""), ("rt p50 ms", "latency_p50"), ("rt p99 ms", "latency_p99"),
            ("rt n", "latency_samples"), ("drain/s", "drain_rate"),
            ("drain/s incl start", "drain_rate_incl_startup"), ("backlog", "drain_tasks"),
            ("publish/s", "publish_rate"), ("result p50 ms", "result_p50"),
            ("result p99 ms", "result_p99")]
    rows = [[head for head, _ in cols]]
    order = [*BROKERS, UNCONFIRMED, FLOOR]
    for name, res in sorted(results.items(), key=lambda item: order.index(item[0])):
        rows.append([name] + [fmt(res.get(key)) for _, key in cols[1:]])
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    out = ["", "Machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), ""] + lines
    out += ["", "Targets:"]
    verdicts = []
    for key, num, den, op, bound, what in TARGETS:
        a, b = results.get(num, {}).get(key), results.get(den, {}).get(key)
        if a is None or b is None:
            out.append(f"  {what:38s} not measured")
            continue
        ratio = a / b
        v = verdict(ratio, op, bound)
        verdicts.append({"target": what, "ratio": ratio, "bound": f"{op} {bound}",
                         "verdict": v})
        out.append(f"  {what:38s} {a:10,.1f} / {b:10,.1f} = {ratio:6.2f}  "
                   f"(target {op} {bound})  {v}")
        floor = results.get(FLOOR, {}).get(key)
        if key in FLOOR_OF and floor is not None:
            floor_ratio = floor / b
            verdicts[-1]["floor_ratio"] = floor_ratio
            reach = ("below the target" if verdict(floor_ratio, op, bound) == "PASS"
                     else "already above the target: unreachable on this machine")
            out.append(f"    floor: bare ZooKeeper requests {floor:10,.1f} / {b:10,.1f} = "
                       f"{floor_ratio:6.2f}  ({reach})")
    if notes:
        out += ["", "Notes:"] + [f"  - {n}" for n in notes]
    return "\n".join(out), verdicts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small sizes (500 tasks, 40 samples, 500 publishes) for a smoke run")
    p.add_argument("--only", default=",".join(BROKERS),
                   help="comma-separated brokers to run: zk,redis,kombu-zk (default all)")
    p.add_argument("--tasks", type=int, default=None, help="drain backlog (default 5000)")
    p.add_argument("--latency-samples", type=int, default=None,
                   help="round-trip samples per broker (default 200; kombu-zk 30)")
    p.add_argument("--publish", type=int, default=None, help="publishes (default 2000)")
    add_server_options(p)
    p.add_argument("--zk-option", action="append", default=[], metavar="KEY=VALUE",
                   help="celery_zk option for the zk broker and backend URLs, repeatable, "
                        "e.g. persistent_watches=false")
    p.add_argument("--skip", default="",
                   help="comma-separated measurements to skip: "
                        "latency,drain,publish,result,floor")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.only = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = set(args.only) - set(BROKERS)
    if unknown:
        p.error(f"--only: unknown broker(s) {sorted(unknown)}; choose from {BROKERS}")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    quick = args.quick
    args.tasks = args.tasks or (500 if quick else 5000)
    args.latency_samples = args.latency_samples or (40 if quick else 200)
    args.publish = args.publish or (500 if quick else 2000)
    return args


def plan(args: argparse.Namespace, name: str) -> tuple[int, int]:
    """(latency samples, drain backlog) for a broker."""
    if name != "kombu-zk":
        return args.latency_samples, args.tasks
    return min(args.latency_samples, KOMBU_ZK_LATENCY_SAMPLES), args.tasks


def run(args: argparse.Namespace) -> int:
    if "redis" in args.only:
        if not os.access(REDIS_SERVER, os.X_OK):
            dev = " or ./dev bench (which installs it)" if os.path.exists(
                os.path.join(HERE, "..", "dev")) else ""
            print(REDIS_HELP.format(dev=dev), file=sys.stderr)
            return 1
    random.seed(1)
    procs = Processes()
    work_dir = tempfile.mkdtemp(prefix="celery-zk-bench-")
    zk: ZooKeeperServer | None = None
    bench = Bench(args, procs, work_dir)
    try:
        zk = measured_server(args)
        zk.start()
        redis = RedisServer(procs, work_dir).start()
        run_id = uuid.uuid4().hex[:8]
        query = "?" + "&".join(args.zk_option) if args.zk_option else ""
        bench.urls = {"zk": f"zk://{zk.hosts}/bench-{run_id}{query}",
                      "redis": redis.url(0),
                      "kombu-zk": f"zookeeper://{zk.hosts}/kombu-bench-{run_id}"}
        bench.backends = {"zk": f"zk://{zk.hosts}/bench-results-{run_id}{query}",
                          "redis": redis.url(1)}
        srvr = four_letter_word("127.0.0.1", zk.port or 0, "srvr")
        zk_version = next((line.split(":", 1)[1].strip().split(",")[0].split("-")[0]
                           for line in srvr.splitlines() if line.startswith("Zookeeper version")),
                          "unknown")
        info = {"nproc": os.cpu_count(), "python": platform.python_version(),
                "zookeeper": zk_version, "zk forceSync": args.zk_force_sync,
                "redis": redis.version(), "celery": celery.__version__,
                "kombu": kombu.__version__, "kazoo": kazoo.__version__,
                "platform": platform.platform()}
        if args.zk_jvm_flag:
            info["zk extra jvm flags"] = " ".join(args.zk_jvm_flag)
        log("  ".join(f"{k}={v}" for k, v in info.items()))
        log(f"ZooKeeper {zk.hosts} (data {zk.data_dir}), redis-server 127.0.0.1:{redis.port}")
        no_backend = backend_available()
        if no_backend and "result" not in args.skip:
            log(f"(d) result round trip skipped: backend not available ({no_backend})")
            bench.notes.append("result round trip skipped: backend not available")
            args.skip.add("result")

        warm_up_zookeeper(zk.hosts)
        selected = [b for b in BROKERS if b in args.only]
        if "floor" not in args.skip and "zk" in args.only:
            floor: dict[str, list[float]] = {}
            for mode in ("handoff", "result-handoff", "claim", "claim-listing", "get-delete",
                         "result", "split"):
                log(f"{FLOOR}: (e) bare ZooKeeper round trip '{mode}' x{args.latency_samples}")
                floor[mode] = measure_floor(zk.hosts, mode, args.latency_samples)
            bench.results[FLOOR] = {
                # celery_zk's default protocol: hand-off to an idle consumer.
                "latency_p50": percentile(floor["handoff"], 50),
                "latency_p99": percentile(floor["handoff"], 99),
                "latency_samples": len(floor["handoff"]),
                "result_p50": percentile(floor["result-handoff"], 50),
                "result_p99": percentile(floor["result-handoff"], 99),
                "result_samples": len(floor["result-handoff"]),
                "claim_p50": percentile(floor["claim"], 50),
                "claim_p99": percentile(floor["claim"], 99),
                "claim_result_p50": percentile(floor["result"], 50),
                "claim_listing_p50": percentile(floor["claim-listing"], 50),
                "claim_listing_p99": percentile(floor["claim-listing"], 99),
                "get_delete_p50": percentile(floor["get-delete"], 50),
                "get_delete_p99": percentile(floor["get-delete"], 99),
                "split_p50": percentile(floor["split"], 50),
                "split_p99": percentile(floor["split"], 99)}
            bench.notes.append(
                f"{FLOOR}: two plain kazoo processes doing only the ZooKeeper requests of "
                "one round trip (benchmarks/floor.py), same pauses; rt = celery_zk's "
                "default protocol (each message handed straight to the idle receiver's "
                "offer: one multi, a watch, one read), result = that request + done-node "
                "write + watch + read. Without hand-off (handoff=false: publish, then a "
                f"claim) rt was p50 {percentile(floor['claim'], 50):.1f} ms and result "
                f"{percentile(floor['result'], 50):.1f} ms; with a child watch and a "
                "listing before each claim (persistent_watches=false) rt "
                f"{percentile(floor['claim-listing'], 50):.1f} ms; reading and deleting "
                "instead of claiming (kombu's built-in protocol) "
                f"{percentile(floor['get-delete'], 50):.1f} ms; the body in a node of its "
                "own, so the claim needs no read first (not built) "
                f"{percentile(floor['split'], 50):.1f} ms")
        if "publish" not in args.skip:
            # Interleaved rounds, median: no broker gets a warmer server by its position.
            publishers = list(selected)
            if "zk" in selected:
                bench.urls[UNCONFIRMED] = (bench.urls["zk"] + ("&" if query else "?")
                                           + "confirm_publish=false")
                publishers.append(UNCONFIRMED)
                bench.notes.append(
                    f"{UNCONFIRMED}: publish only, with the opt-in transport option "
                    "confirm_publish=false (pipelined; in-flight messages are lost if the "
                    "process is killed). The publish target uses the default, zk")
            rates: dict[str, list[float]] = {name: [] for name in publishers}
            for round_ in range(PUBLISH_ROUNDS):
                # Every other round in reverse: each broker goes first equally often.
                for name in publishers if round_ % 2 == 0 else publishers[::-1]:
                    log(f"{name}: (c) publish {args.publish} tasks, round {round_ + 1}")
                    rates[name].append(bench.publish(name, args.publish)["publish_rate"])
            for name in publishers:
                bench.results.setdefault(name, {}).update(
                    publish_rate=statistics.median(rates[name]), publish_count=args.publish,
                    publish_rounds=[round(r, 1) for r in rates[name]])
        for name in selected:
            res = bench.results.setdefault(name, {})
            samples, backlog = plan(args, name)
            if "latency" not in args.skip:
                log(f"{name}: (a) idle round trip x{samples}")
                res.update(bench.latency(name, samples))
            if "drain" not in args.skip:
                if name == "kombu-zk":
                    # Keep its drain within the budget; estimate from a probe drain.
                    probe = bench.drain(name, min(200, backlog))
                    fits = int(probe["drain_rate"] * KOMBU_ZK_DRAIN_BUDGET)
                    if fits < backlog:
                        bench.notes.append(
                            f"kombu-zk drain used a {fits}-task backlog instead of {backlog}: "
                            f"at its probed {probe['drain_rate']:.0f} tasks/s the full backlog "
                            f"would take > {KOMBU_ZK_DRAIN_BUDGET:.0f}s")
                        backlog = max(200, fits)
                log(f"{name}: (b) drain a {backlog}-task backlog")
                res.update(bench.drain(name, backlog))
            if "result" not in args.skip and name in bench.backends:
                log(f"{name}: (d) result round trip x{args.latency_samples}")
                res.update(bench.result(name, args.latency_samples))
            log(f"{name}: " + ", ".join(f"{k}={fmt(v)}" for k, v in res.items()))

        if "kombu-zk" in args.only and "latency" not in args.skip:
            bench.notes.append(
                f"kombu-zk polls every 1 s (its polling_interval), so its round trip is "
                f"~1-2 s; it ran {plan(args, 'kombu-zk')[0]} samples instead of "
                f"{args.latency_samples}")
        bench.notes.append(
            f"ZooKeeper forceSync={args.zk_force_sync} (data dir on "
            f"{filesystem_of(zk.data_dir)}); redis-server runs with no persistence "
            "(--save '' --appendonly no)")
        bench.notes.append(
            "ZooKeeper runs with production JVM flags (" + " ".join(
                f for f in SERVER_JVM_FLAGS if f.startswith("-X")) + ", full JIT) and "
            "tickTime=2000" + "".join(f"; {flag}" for flag in args.zk_jvm_flag))
        if args.zk_option:
            bench.notes.append("zk URLs with " + " ".join(args.zk_option))
        bench.notes.append("drain/s is first to last task executed, measured in the worker; "
                           "'incl start' is from worker spawn to last task executed")
        text, verdicts = render(bench.results, info, bench.notes)
        print(text, flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump({"info": info, "results": bench.results, "targets": verdicts,
                           "notes": bench.notes, "args": {
                               k: (sorted(v) if isinstance(v, set) else v)
                               for k, v in vars(args).items()}}, fh, indent=2)
            log(f"wrote {args.json}")
        return 0
    finally:
        # Clients this process still holds would log their reconnect attempts.
        logging.getLogger("kazoo").setLevel(logging.CRITICAL)
        procs.stop_all()
        if zk is not None:
            zk.close()
        shutil.rmtree(work_dir, ignore_errors=True)


def filesystem_of(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True,
                             check=True).stdout.splitlines()[-1].split()
        return f"{out[1]} {out[0]}"
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown filesystem"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\ninterrupted; every process the benchmark started was stopped",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
