"""A nemesis soak: real partitions, kills and pauses under a steady Celery load on zk://.

    sudo .venv/bin/python benchmarks/nemesis --minutes 30 --seed 7 --json nemesis.json
    sudo .venv/bin/python benchmarks/nemesis --short --seed 1 --json short.json

A three-member ZooKeeper ensemble, three ``celery worker`` hosts (threads,
prefork, threads; ``-c 2``) and a publisher, each in a network namespace of
its own on one bridge (:mod:`common.net`, :mod:`nemesis.cluster`); a
publisher at a steady rate of ``acks_late`` tasks with results, chords,
priorities, countdowns and revokes (:mod:`nemesis.publisher`); a nemesis on a
seeded plan of partitions, SIGKILLs and SIGSTOPs (:mod:`nemesis.schedule`,
:mod:`nemesis.faults`), the dispatcher's holder a favoured target
(:mod:`nemesis.dispatcher`). Then everything is healed, the backlog drained,
and the history checked (:mod:`nemesis.checker`, :mod:`nemesis.state`,
:mod:`nemesis.recovery`). Exit status 0 only when nothing was lost or stuck,
every property held and the members agree. Needs root (namespaces); installs
Debian's ``nftables`` if ``nft`` is missing. See docs/nemesis.md.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import statistics
import tempfile
import time
from typing import Any

from common.net import Network, ensure_tools, exclusive, remove_leftovers

from .checker import History, check
from .cluster import ROOT, Cluster, WorkerSpec
from .dispatcher import LOOKUPS
from .faults import Nemesis, log
from .history import PUBLISHER, Follower, read_executions, read_journal
from .recovery import measure
from .schedule import plan, short_seconds
from .state import broadcast_reach, compare_members, queue_leftovers, read_results

ZK_HOSTS = ["zk1", "zk2", "zk3"]
POOLS = ["threads", "prefork", "threads"]
PUBLISHER_HOST = "pub"
TASK_QUEUE = "celery"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0,
                        help="how long the nemesis acts (default 30; --short sets its own)")
    parser.add_argument("--seed", type=int, default=None,
                        help="the plan's seed (default: from the clock, printed and saved)")
    parser.add_argument("--json", metavar="FILE", help="write the report here")
    parser.add_argument("--short", action="store_true",
                        help="every fault kind once, short durations: 2-4 minutes in all")
    parser.add_argument("--rate", type=float, default=50.0,
                        help="publishes per second (default 50; chords count as one)")
    parser.add_argument("--workers", type=int, default=3, choices=(2, 3),
                        help="worker hosts (threads, prefork, threads), -c 2 each")
    parser.add_argument("--dispatcher", choices=sorted(LOOKUPS), default="auto",
                        help="how the dispatcher's holder is found (default auto: the "
                             "queue's consumers/ once it exists, else the recovery leader)")
    parser.add_argument("--work-dir", help="journals and logs (default: a new temp dir)")
    parser.add_argument("--drain-timeout", type=float, default=None,
                        help="seconds the final drain may take (default 300; short 150)")
    parser.add_argument("--no-dedupe", action="store_true",
                        help="workers without worker_deduplicate_successful_tasks")
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = int(time.time()) % 100_000
    if args.drain_timeout is None:
        args.drain_timeout = 150.0 if args.short else 300.0
    return args


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)   # unwinds into the finally that tears down


def _expected_ids(publisher: list[dict[str, Any]]) -> tuple[set[str], set[str]]:
    """(every task id published, the revoked ones)."""
    ids: set[str] = set()
    for entry in publisher:
        if entry["e"] == "publish":
            ids.add(entry["id"])
            ids.update(entry.get("parts", []))
    return ids, {e["id"] for e in publisher if e["e"] == "revoke"}


def drain(cluster: Cluster, work_dir: str, timeout: float) -> float:
    """Wait until every published task (the revoked aside) has completed and the task
    queue is empty; returns the seconds it took (the timeout if it never was)."""
    expected, revoked = _expected_ids(read_journal(os.path.join(work_dir, PUBLISHER)))
    waiting = expected - revoked
    follower = Follower(work_dir)
    began = time.monotonic()
    assert cluster.observer is not None
    while time.monotonic() - began < timeout:
        waiting -= {e["id"] for e in follower.new_entries() if e["e"] == "end"}
        if not waiting:
            try:
                if TASK_QUEUE not in queue_leftovers(cluster.observer, ROOT):
                    return time.monotonic() - began
            except Exception as exc:   # the observer reconnecting: look again
                log(f"drain: could not list the queue ({exc!r})")
        time.sleep(2)
    log(f"drain: {len(waiting)} task(s) still not completed after {timeout:.0f}s")
    return timeout


def heal_everything(cluster: Cluster) -> None:
    """No partition, every member and worker running and none paused."""
    cluster.net.heal()
    for index, member in enumerate(cluster.ensemble.members):
        if member.pid is not None:
            os.killpg(member.pid, signal.SIGCONT)
        if not member.running:
            log(f"restarting {cluster.zk_hosts[index]}")
            member.start(timeout=60)
    cluster.ensemble.wait_for_quorum(timeout=120)
    for name, worker in cluster.workers.items():
        if worker.paused:
            worker.resume()
        if not worker.running:
            log(f"restarting {name}")
            worker.start()


def revokes_heard(work_dir: str, cluster: Cluster) -> dict[str, dict[str, float]]:
    """{worker: {task id: when its log says it was told the task was revoked}}."""
    heard: dict[str, dict[str, float]] = {}
    for name, worker in cluster.workers.items():
        told: dict[str, float] = {}
        with open(worker.log_path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                marker = line.find("Tasks flagged as revoked: ")
                if marker < 0 or not line.startswith("["):
                    continue
                at = time.mktime(time.strptime(line[1:20], "%Y-%m-%d %H:%M:%S"))
                at += int(line[21:24]) / 1000
                for task_id in line[marker + 26:].split(","):
                    told.setdefault(task_id.strip(), at)
        heard[name] = told
    return heard


def summarize(values: list[float | None]) -> dict[str, Any]:
    got = [v for v in values if v is not None]
    return {"p50": round(statistics.median(got), 2) if got else None,
            "max": round(max(got), 2) if got else None,
            "not_recovered": len(values) - len(got)}


def report(args: argparse.Namespace, work_dir: str, cluster: Cluster, faults: list[Any],
           nemesis_started: float, publishing: tuple[float, float], drained_in: float,
           leftovers: dict[str, list[str]], consistency: dict[str, Any],
           reach: dict[str, bool]) -> dict[str, Any]:
    publisher = read_journal(os.path.join(work_dir, PUBLISHER))
    executions = read_executions(work_dir)
    history = History.build(publisher, executions)
    results = read_results(cluster.url, history.expected)
    fault_dicts = [f.to_json() for f in faults]
    deaf = {worker for worker, answered in reach.items() if not answered}
    summary = check(history, results, fault_dicts, deaf, revokes_heard(work_dir, cluster))

    completions = sorted(t for t in (history.first_end(i) for i in history.expected
                                     if i not in history.revoked) if t is not None)
    due_and_done = history.due_and_done()
    steady = [m for m in history.expected.values() if m["kind"] != "countdown"
              and m["kind"] != "revoke"]
    offered = len(steady) / max(1e-9, publishing[1] - publishing[0])
    measure(fault_dicts, publishing[1], time.time(), completions, due_and_done, offered)
    for fault in fault_dicts:
        fault["t"] = round(fault["started"] - nemesis_started, 1)
        fault["duration_s"] = round((fault["healed"] or fault["started"]) - fault["started"], 1)

    stuck = sum(len(paths) for paths in leftovers.values())
    violations = list(summary.pop("violations"))
    if stuck:
        violations.append(f"{stuck} message(s) stuck in owned/ or unowned/")
    if not consistency.get("consistent"):
        violations.append("the members' data differ")
    if deaf:
        violations.append(f"worker(s) {sorted(deaf)} no longer receive broadcasts")
    return {
        "seed": args.seed,
        "mode": "short" if args.short else "long",
        "minutes": round((publishing[1] - publishing[0]) / 60, 2),
        "rate": args.rate,
        "offered_tasks_per_s": round(offered, 1),
        "workers": {name: spec.pool for name, spec in cluster.specs.items()},
        **summary,
        "stuck": {"count": stuck, "nodes": {q: p[:20] for q, p in leftovers.items()}},
        "drain_s": round(drained_in, 1),
        "faults": fault_dicts,
        "recovery": {"recover_s": summarize([f["recover_s"] for f in fault_dicts]),
                     "caught_up_s": summarize([f["caught_up_s"] for f in fault_dicts])},
        "consistency": consistency,
        "broadcast_reach": reach,
        "violations": violations,
        "ok": not violations,
        "work_dir": work_dir,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    ensure_tools()
    lock = exclusive()   # held until this process ends
    left = remove_leftovers()
    if left:
        log(f"removed what an earlier run left: {', '.join(left)}")
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="celery-zk-nemesis-")
    os.makedirs(work_dir, exist_ok=True)
    workers = [WorkerSpec(f"w{i + 1}", POOLS[i]) for i in range(args.workers)]
    worker_names = [w.name for w in workers]
    net = Network([*ZK_HOSTS, *worker_names, PUBLISHER_HOST])
    cluster: Cluster | None = None
    nemesis: Nemesis | None = None
    try:
        net.create()
        cluster = Cluster(work_dir, net, ZK_HOSTS, workers, PUBLISHER_HOST,
                          dedupe=not args.no_dedupe)
        cluster.start()
        log(f"seed {args.seed}: ensemble {cluster.hosts}, workers {worker_names}, "
            f"journals in {work_dir}")
        cluster.start_publisher(args.rate, args.seed)
        publish_started = time.time()
        time.sleep(8 if args.short else 20)   # a steady state before the first fault
        seconds = (short_seconds(ZK_HOSTS, worker_names, args.seed) if args.short
                   else args.minutes * 60)
        faults = plan(args.seed, seconds, ZK_HOSTS, worker_names, short=args.short)
        log(f"{len(faults)} faults planned over {seconds:.0f}s")
        nemesis = Nemesis(cluster, LOOKUPS[args.dispatcher], args.seed)
        nemesis_started = time.time()
        began = time.monotonic()
        applied = nemesis.run(faults, began, began + seconds + 1)
        time.sleep(12 if args.short else 30)   # load after the last heal: its recovery shows
        heal_everything(cluster)
        cluster.stop_publisher()
        publish_ended = time.time()
        log("publisher stopped; draining")
        # The drain is bounded, but a call that never returns (a client's) is not:
        # then every thread's stack goes to stderr, to say where it hung.
        faulthandler.dump_traceback_later(args.drain_timeout + 60, exit=False)
        drained_in = drain(cluster, work_dir, args.drain_timeout)
        assert cluster.observer is not None
        leftovers = queue_leftovers(cluster.observer, ROOT)
        reach = broadcast_reach(cluster.url, cluster.workers)
        faulthandler.cancel_dump_traceback_later()
        log(f"drained in {drained_in:.1f}s; broadcasts reach {reach}; stopping the workers")
        cluster.stop_workers()
        log("comparing the members' data")
        consistency = compare_members(cluster.ensemble, ROOT)
        log("checking the history")
        return report(args, work_dir, cluster, applied, nemesis_started,
                      (publish_started, publish_ended), drained_in, leftovers, consistency,
                      reach)
    except BaseException as exc:
        log(f"stopping ({exc!r}): tearing everything down")
        raise
    finally:
        # A second Ctrl-C must not cut the teardown short: it leaves no namespace.
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        try:
            if nemesis is not None:
                nemesis.heal()
        finally:
            if cluster is not None:
                cluster.stop()
            net.destroy()
            remove_leftovers()
            lock.close()


def print_summary(result: dict[str, Any]) -> None:
    recovery = result["recovery"]
    lines = [
        f"seed {result['seed']} ({result['mode']}, {result['minutes']} min, "
        f"{result['offered_tasks_per_s']} tasks/s offered)",
        f"published {result['published']}  executed {result['executed']}  "
        f"lost {result['lost']['count']}  duplicated {result['duplicated']['count']} "
        f"{result['duplicated']['why']}  stuck {result['stuck']['count']}",
        f"faults {len(result['faults'])}: recover p50/max "
        f"{recovery['recover_s']['p50']}/{recovery['recover_s']['max']} s, caught up p50/max "
        f"{recovery['caught_up_s']['p50']}/{recovery['caught_up_s']['max']} s",
        f"members consistent: {result['consistency']['consistent']}",
        "OK" if result["ok"] else "VIOLATIONS: " + "; ".join(result["violations"][:10]),
    ]
    for line in lines:
        log(line)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The observer's reconnects are expected during faults; the workers' logs keep theirs.
    logging.getLogger("kazoo").setLevel(logging.ERROR)
    signal.signal(signal.SIGINT, signal.default_int_handler)   # even when started in the background
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_exit)
    result = run(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    print_summary(result)
    return 0 if result["ok"] else 1
