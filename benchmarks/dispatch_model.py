"""A raw-kazoo model of delivering one queue to K consumer processes (issue 26, item 5).

No Celery, no kombu: publishers, consumers and (in two variants) a dispatcher
talk to ZooKeeper with kazoo, so the figures show what each *design* costs
before any transport code is written. Every message is a 600-byte node;
every consumer holds at most ``--credit`` (4) messages that are not yet
acked, acks several in one multi (up to 16, or 5 ms, and at once when it has
nothing else in hand), and each message must be acked exactly once: the run
checks the count, duplicates and losses at the end, and that nothing is left.

Variants (each at K = 1, 4, 16 consumer processes):

* ``selfclaim``: today's celery_zk. Every consumer lists the head bucket
  (sorted, cached up to 1 s), takes its slice, reads the bodies and claims
  them with one multi {delete unowned (version-checked), create
  ``owned/{consumer}~{name}`` with the body}; a conflict drops the name lost
  and retries the rest (``celery_zk/broker/claims.py``, ``queue_view.py``).
* ``dispatch-copy``: one dispatcher (a thread in consumer 0, or with
  ``--dispatcher process`` a process of its own) lists ``unowned/``, reads
  the bodies, and moves messages with their bodies into the inboxes
  ``owned/{consumer}/`` of consumers with free credit, many consumers in one
  multi, each consumer's part guarded by a ``check`` of its ephemeral
  ``consumers/{consumer}`` node. Consumers watch only their inbox, read, and
  ack by deleting.
* ``dispatch-names``: the publisher creates, in one multi, an empty
  sequential name ``n0-{gen}-{uid}-{seq}`` and the body ``b-{uid}`` beside it
  in the bucket; the dispatcher moves only names (never reads a body); a
  consumer reads the body from the bucket and acks with one multi deleting
  its inbox entry and the body.

The dispatcher learns of free credit from a child watch on each inbox
(acks shrink it) and re-lists the inbox, or (``credit_watch=tree``) from
one persistent recursive watch on ``owned/`` whose delete events name each
acked entry. Which watches, reads and client paths are used is the
*tuning*; ``--parts ladder`` adds one change at a time and measures each.

Parts (``--parts``, default all):

* ``table``: 20,000 preloaded messages drained, every variant x K: messages/s,
  CPU seconds per 1,000 messages (Python processes / the ZooKeeper JVM, from
  ``/proc/<pid>/stat``), write transactions and failed ones per message
  (publishing excluded), ZooKeeper's zxid count per message as a check.
  Run with the baseline tuning and with the tuned one.
* ``steady``: a publisher at ``--rate`` messages/s meanwhile, same figures
  plus the publish-to-consumer latency.
* ``watch``: the dispatcher's ``unowned/`` watch under a steady publisher:
  child watches and re-listing against one persistent recursive watch.
* ``latency``: idle latency, from a publisher's create returning to a
  consumer holding the body (a) through the dispatcher, (b) published
  straight into an idle consumer's inbox in place of the offer it left.
* ``ladder``: dispatch-names at K = 16 (``--ladder-ks``), one client-cost
  change after another.
* ``sizes``: dispatch-copy against dispatch-names, tuned, with bodies of
  ``--sizes`` bytes (600, 8,000, 32,000; fewer messages as they grow).

The model itself is the package ``benchmarks/dispatch/``: ``config`` (tuning,
names, counters), ``consumers``, ``dispatcher``, ``processes`` (entry points,
publishing), ``measure`` (CPU, zxid, exactly-once checks, idle latency) and
``wire`` (what kazoo lacks: multiRead, persistent watches, replies on its
connection thread, a cheaper select loop).

Run it alone on the machine (two cores are easily saturated)::

    flock /tmp/celery_zk-bench.lock .venv/bin/python benchmarks/dispatch_model.py \\
        --json dispatch.json                                   # everything, ~40 minutes
    flock /tmp/celery_zk-bench.lock .venv/bin/python benchmarks/dispatch_model.py --quick
    .venv/bin/python benchmarks/dispatch_model.py --parts table --variants dispatch-names \\
        --ks 16 --tuning tuned --messages 5000

Options: ``--quick`` (2,000 messages, 60 latency samples: a check that every
part works, figures not meant to be quoted), ``--variants``, ``--ks``,
``--parts``, ``--tuning baseline|tuned|both`` (for table and steady),
``--messages`` (20,000), ``--steady-messages`` (8,000), ``--rate`` (400/s),
``--samples`` (300), ``--ladder-ks`` (16, also the sizes part's K),
``--sizes``, ``--dispatcher thread|process``, ``--refill-at`` (free credits
before a consumer is refilled, 2), ``--no-warm-run``, ``--json FILE``, and
ZooKeeper's ``--zk-force-sync``/``--zk-jvm-flag``. Every run checks exactly-once
delivery; a run that fails it is marked ``!`` and makes the exit status 1.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    add_server_options,
    log,
    measured_server,
    table,
    warm_up_zookeeper,
)
from dispatch.config import BASELINE, TUNED, VARIANTS, Run, Tuning  # noqa: E402
from dispatch.measure import drain, idle_latency  # noqa: E402

from celery_zk.server import ZooKeeperServer  # noqa: E402


# -- the parts --------------------------------------------------------------------------
def row(fig: dict[str, Any], label: str) -> list[str]:
    flag = "" if not fig["errors"] else " !"
    lat = fig.get("latency_ms")
    return [label, str(fig["k"]), f"{fig['msgs_per_s']:,.0f}{flag}",
            f"{fig['cpu_python_per_1000']:.2f} / {fig['cpu_zk_per_1000']:.2f} / "
            f"{fig.get('cpu_other_per_1000', 0):.2f}",
            f"{fig['txn_per_msg']:.3f}", f"{fig['failed_per_msg']:.4f}",
            f"{fig['zxid_per_msg']:.2f}", f"{fig['reads_per_msg']:.2f}",
            f"{fig['events_per_msg']:.2f}",
            f"{fig['moves_per_multi'] or '-'} / {fig['acks_per_multi']}",
            f"{lat['p50']:.1f} / {lat['p99']:.1f}" if lat else "-"]


HEADER = ["variant", "K", "msgs/s", "CPU s/1k py / zk / other", "txn/msg", "failed/msg", "zxid/msg",
          "reads/msg", "events/msg", "per multi mv/ack", "lat p50/p99 ms"]


def show(title: str, rows: list[list[str]]) -> None:
    print(f"\n{title}", flush=True)
    for line in table([HEADER] + rows):
        print("  " + line, flush=True)


def measure(zk: ZooKeeperServer, run: Run, label: str, out: list[dict[str, Any]],
            rows: list[list[str]]) -> dict[str, Any]:
    fig = drain(zk, run)
    fig["label"] = label
    out.append(fig)
    rows.append(row(fig, label))
    for line in table([HEADER, rows[-1]])[2:]:
        log(line, "model")
    if fig["errors"]:
        log(f"ERRORS: {fig['errors'][:5]}", "model")
    return fig


def part_table(zk: ZooKeeperServer, args: argparse.Namespace, tuning: Tuning, name: str,
               out: dict[str, Any]) -> None:
    rows: list[list[str]] = []
    figs: list[dict[str, Any]] = []
    for variant in args.variants:
        for k in args.ks:
            run = Run(variant, k, args.messages, _for_variant(tuning, variant),
                      dispatcher=args.dispatcher, refill_at=args.refill_at)
            measure(zk, run, variant, figs, rows)
    out[f"table_{name}"] = figs
    show(f"drain of {args.messages:,} preloaded messages, tuning {name} ({tuning.label()})", rows)


def part_steady(zk: ZooKeeperServer, args: argparse.Namespace, tuning: Tuning, name: str,
                out: dict[str, Any]) -> None:
    rows: list[list[str]] = []
    figs: list[dict[str, Any]] = []
    for variant in args.variants:
        for k in args.ks:
            run = Run(variant, k, args.steady_messages, _for_variant(tuning, variant),
                      mode="steady", rate=args.rate, dispatcher=args.dispatcher,
                      refill_at=args.refill_at)
            measure(zk, run, variant, figs, rows)
    out[f"steady_{name}"] = figs
    show(f"steady publisher at {args.rate:,.0f}/s, {args.steady_messages:,} messages, "
         f"tuning {name}", rows)


def part_watch(zk: ZooKeeperServer, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """The dispatcher's unowned/ watch: child watches + listing vs a persistent one."""
    rows: list[list[str]] = []
    figs: list[dict[str, Any]] = []
    for rate in (args.rate, args.rate * 2):
        for k in args.ks:
            for watch in ("child", "tree"):
                run = Run("dispatch-names", k, args.steady_messages,
                          replace(TUNED, unowned_watch=watch), mode="steady", rate=rate,
                          dispatcher=args.dispatcher, refill_at=args.refill_at)
                measure(zk, run, f"unowned={watch} @{rate:,.0f}/s", figs, rows)
    out["watch"] = figs
    show("dispatcher's unowned/ watch under a steady publisher (dispatch-names, tuned)", rows)


def part_latency(zk: ZooKeeperServer, args: argparse.Namespace, out: dict[str, Any]) -> None:
    results = []
    k = 4
    cases = [("dispatch-names", "latency-dispatch", replace(TUNED, unowned_watch="tree")),
             ("dispatch-names", "latency-dispatch", replace(TUNED, unowned_watch="child")),
             ("dispatch-copy", "latency-dispatch", replace(TUNED, unowned_watch="tree")),
             ("dispatch-names", "latency-dispatch", BASELINE),
             ("dispatch-copy", "latency-direct", TUNED),
             ("dispatch-copy", "latency-direct", BASELINE)]
    for variant, mode, tuning in cases:
        run = Run(variant, k, 0, tuning, mode=mode, dispatcher=args.dispatcher,
                  refill_at=args.refill_at)
        res = idle_latency(zk, run, args.samples)
        client = "tuned" if tuning.inline else "baseline"
        label = (f"(a) dispatcher {variant} {client} unowned={tuning.unowned_watch}"
                 if mode == "latency-dispatch" else f"(b) direct {client}")
        res["label"] = label
        results.append(res)
        log(f"{label}: p50 {res['p50_ms']:.2f} ms, p99 {res['p99_ms']:.2f} ms "
            f"(n={res['samples']})", "model")
    out["latency"] = results
    print("\nidle latency, publisher's create returning -> consumer holds the body "
          f"(K = {k}, {args.samples} samples, 20-50 ms apart)")
    for line in table([["path", "p50 ms", "p99 ms"]] + [
            [r["label"], f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}"] for r in results]):
        print("  " + line)


#: One change after another (dispatch-names): label, tuning, refill_at, dispatcher.
def _ladder() -> list[tuple[str, Tuning, int, str]]:
    steps: list[tuple[str, dict[str, Any]]] = [
        ("1 reads one at a time (what pipelining saves)", {"reads": "seq"}),
        ("2 + plain select() in kazoo's loop", {"handler": "select"}),
        ("3 + one recv() for all the socket holds", {"buffered": True}),
        ("4 + inbox: persistent watch, names in events", {"inbox_watch": "tree"}),
        ("5 + credit: persistent watch on owned/", {"credit_watch": "tree"}),
        ("6 + requests built directly", {"raw": True}),
        ("7 + multiRead of a batch's bodies", {"reads": "multi"}),
        ("8 + replies on kazoo's thread", {"inline": True}),
        ("9 + batch marks: a read, a hand-off, an ack per batch", {"batches": True}),
        ("10 + one move, one ack multi in flight at a time", {"one_in_flight": True}),
    ]
    ladder = [("0 baseline: child watches, pipelined gets", BASELINE, 2, "thread")]
    tuning = BASELINE
    for label, change in steps:
        if label.startswith("1 "):   # a step back, not kept
            ladder.append((label, replace(BASELINE, **change), 2, "thread"))
            continue
        tuning = replace(tuning, **change)
        ladder.append((label, tuning, 2, "thread"))
    assert tuning == TUNED, "the last step of the ladder is the tuned client"
    ladder.append(("11 tuned, refilled at 1 free credit", TUNED, 1, "thread"))
    ladder.append(("12 tuned, refilled only when empty", TUNED, 4, "thread"))
    ladder.append(("13 tuned, the dispatcher a process of its own", TUNED, 2, "process"))
    ladder.append(("14 tuned, credit from child watches + listing", replace(
        TUNED, credit_watch="child"), 2, "thread"))
    return ladder


def part_ladder(zk: ZooKeeperServer, args: argparse.Namespace, out: dict[str, Any]) -> None:
    rows: list[list[str]] = []
    figs: list[dict[str, Any]] = []
    for k in args.ladder_ks:
        for label, tuning, refill_at, dispatcher in _ladder():
            run = Run("dispatch-names", k, args.messages, tuning, dispatcher=dispatcher,
                      refill_at=refill_at)
            measure(zk, run, label, figs, rows)
    out["ladder"] = figs
    show("per-message client cost, one change at a time (dispatch-names)", rows)


def part_sizes(zk: ZooKeeperServer, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Item 4 of the issue: does copying bodies cost the dispatcher when they grow?"""
    rows: list[list[str]] = []
    figs: list[dict[str, Any]] = []
    for size in args.sizes:
        # Fewer messages as they grow: the backlog must fit ZooKeeper's 512 MB heap.
        count = min(args.messages, max(1_000, 64_000_000 // size))
        for variant in ("dispatch-copy", "dispatch-names"):
            for k in args.ladder_ks:
                run = Run(variant, k, count, TUNED, size=size, dispatcher=args.dispatcher,
                          refill_at=args.refill_at)
                measure(zk, run, f"{variant} {size:,} B", figs, rows)
    out["sizes"] = figs
    show("bodies copied by the dispatcher, or stored once (tuned)", rows)


def _for_variant(tuning: Tuning, variant: str) -> Tuning:
    """selfclaim has no inbox and no dispatcher: only its reads and client path vary."""
    if variant == "selfclaim":
        return replace(tuning, inbox_watch="child", credit_watch="child",
                       unowned_watch="child", inline=False)
    return tuning


PARTS = ("table", "steady", "watch", "latency", "ladder", "sizes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes: checks every part, figures not to be quoted")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--ks", default="1,4,16")
    parser.add_argument("--ladder-ks", default="16")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--tuning", choices=("baseline", "tuned", "both"), default="both")
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--steady-messages", type=int, default=8_000)
    parser.add_argument("--rate", type=float, default=400.0,
                        help="steady publisher, messages/s (default 400)")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--sizes", default="600,8000,32000",
                        help="message sizes of the sizes part, bytes")
    parser.add_argument("--dispatcher", choices=("thread", "process"), default="thread")
    parser.add_argument("--refill-at", type=int, default=2,
                        help="free credits a consumer needs before the dispatcher refills it")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--no-warm-run", action="store_true",
                        help="skip the unreported warm-up drains")
    add_server_options(parser)
    args = parser.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    args.ks = [int(k) for k in args.ks.split(",") if k]
    args.ladder_ks = [int(k) for k in args.ladder_ks.split(",") if k]
    args.sizes = [int(size) for size in args.sizes.split(",") if size]
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        parser.error(f"unknown part(s); choose from {', '.join(PARTS)}")
    if args.quick:
        args.messages, args.steady_messages, args.samples = 2_000, 1_000, 60
    tunings = {"baseline": [("baseline", BASELINE)], "tuned": [("tuned", TUNED)],
               "both": [("baseline", BASELINE), ("tuned", TUNED)]}[args.tuning]
    logging.basicConfig(level=logging.WARNING)
    out: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}}
    with measured_server(args) as zk:
        zk.start()
        warm_up_zookeeper(zk.hosts)
        log(f"ZooKeeper pid {zk.pid} at {zk.hosts}", "model")
        if not args.no_warm_run:
            # Not reported: the JVM compiles the multi, check and watch paths
            # before the first figures, so the first variant does not pay for it.
            for variant, tuning in (("selfclaim", BASELINE), ("dispatch-names", TUNED)):
                fig = drain(zk, Run(variant, 4, min(args.messages, 4_000), tuning))
                log(f"warm-up run {variant}: {fig['msgs_per_s']:,.0f}/s", "model")
        try:
            for part in parts:
                if part == "table":
                    for name, tuning in tunings:
                        part_table(zk, args, tuning, name, out)
                elif part == "steady":
                    for name, tuning in tunings:
                        part_steady(zk, args, tuning, name, out)
                elif part == "watch":
                    part_watch(zk, args, out)
                elif part == "latency":
                    part_latency(zk, args, out)
                elif part == "ladder":
                    part_ladder(zk, args, out)
                elif part == "sizes":
                    part_sizes(zk, args, out)
        finally:
            if args.json:
                with open(args.json, "w", encoding="utf-8") as fh:
                    json.dump(out, fh, indent=2)
                log(f"wrote {args.json}", "model")
    bad = [f for key, figs in out.items() if isinstance(figs, list) for f in figs
           if isinstance(f, dict) and f.get("errors")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
