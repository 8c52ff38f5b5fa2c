"""``workers.py``'s report: the tables, and issue 60's targets PASS or MISS."""
from __future__ import annotations

import argparse
import statistics
from typing import Any, Optional

from .figures import PAIRS, table
from .latency import render as render_latency

Results = dict[str, dict[str, Any]]


def verdict(value: float, op: str, bound: float) -> str:
    ok = value <= bound if op == "<=" else value >= bound
    return "PASS" if ok else "MISS"


def _get(results: Results, *path: str) -> Any:
    node: Any = results
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def scaling(results: Results, ks: list[int]) -> list[str]:
    heads = [f"K={k}" for k in ks]
    steps = list(zip(ks, ks[1:]))
    rows = [["tasks/s", *heads, *(f"K={b}÷K={a}" for a, b in steps)]]
    cpu = [["CPU ms per task", *heads]]
    for name, res in results.items():
        rate = [_get(res, "scaling", str(k), "rate") for k in ks]
        if any(r is not None for r in rate):
            rows.append([name, *(_cell(r, ",.0f") for r in rate),
                         *(_ratio(_get(res, "scaling", str(b), "rate"),
                                  _get(res, "scaling", str(a), "rate")) for a, b in steps)])
            cpu.append([name, *(_cell(_get(res, "scaling", str(k), "cpu_ms_per_task"), ".2f")
                                for k in ks)])
    for ours, other in PAIRS:
        if other in results and ours in results:
            for lines, key in ((rows, "rate"), (cpu, "cpu_ms_per_task")):
                lines.append([f"{ours} ÷ {other}", *(_ratio(
                    _get(results, ours, "scaling", str(k), key),
                    _get(results, other, "scaling", str(k), key)) for k in ks)]
                    + [""] * (len(lines[0]) - len(ks) - 1))
    out = [*table(rows), "", *table(cpu)]
    for name in ("zk", "zk3"):
        if zk := _get(results, name, "scaling"):
            txn = [[f"{name}, per delivered task", *heads]]
            for label, key in (("failed transactions (server log)", "failed_per_message"),
                               ("all transactions (server log)", "txns_per_message"),
                               ("requests received (srvr, all members)",
                                "requests_per_message"),
                               ("packets sent: replies, watch events",
                                "packets_sent_per_message")):
                txn.append([label, *(_cell(_get(zk, str(k), key), ".3f") for k in ks)])
            out += ["", *table(txn)]
    return out


def single(results: Results) -> list[str]:
    runs = list(dict.fromkeys(run for res in results.values() for run in res.get("single", {})))
    if not runs:
        return []
    rows = [["one worker", *(f"{run} tasks/s" for run in runs),
             *(f"{run} CPU ms" for run in runs)]]
    for name, res in results.items():
        if "single" in res:
            rows.append([name, *(_cell(_get(res, "single", run, "rate"), ",.0f") for run in runs),
                         *(_cell(_get(res, "single", run, "cpu_ms_per_task"), ".2f")
                           for run in runs)])
    for ours, other in PAIRS:
        if other in results and ours in results:
            rows.append([f"{ours} ÷ {other}", *(
                _ratio(_get(results, ours, "single", run, key),
                       _get(results, other, "single", run, key))
                for key in ("rate", "cpu_ms_per_task") for run in runs)])
    return table(rows)


def median_of(rounds: list[Any]) -> Any:
    """Each number the median of its value in ``rounds`` (the same shape of results,
    one per round); anything else as the first round has it."""
    present = [value for value in rounds if value is not None]
    if not present:
        return None
    first = present[0]
    if isinstance(first, dict):
        keys = dict.fromkeys(key for value in present if isinstance(value, dict)
                             for key in value)
        return {key: median_of([value.get(key) for value in present
                                if isinstance(value, dict)]) for key in keys}
    numbers = [value for value in present
               if isinstance(value, (int, float)) and not isinstance(value, bool)]
    if len(numbers) == len(present) and numbers:
        return statistics.median(numbers)
    return first


Check = tuple[str, Optional[float], str, float]


def checks(results: Results, ks: list[int]) -> list[Check]:
    """Issue 60's "Done when" (the replicated shape, then one server), each a
    ratio against a bound."""
    def div(*paths: tuple[str, ...]) -> float | None:
        a, b = (_get(results, *path) for path in paths)
        return a / b if a is not None and b else None

    def zk3(*path: str) -> float | None:
        return div(("zk3", *path), ("rabbitmq3", *path))

    found: list[Check] = [(f"zk3 ÷ rabbitmq3 rate, K={k}", zk3("scaling", str(k), "rate"),
                           ">=", 1.5) for k in ks]
    found.append(("zk3 ÷ rabbitmq3 drain, one threads -c 4 worker",
                  zk3("single", "threads -c 4", "rate"), ">=", 1.5))
    for state in ("idle", "loaded"):
        found += [(f"zk3 ÷ rabbitmq3 oneway {state} {pct}",
                   zk3("latency", f"oneway {state}", pct), "<=", bound)
                  for pct, bound in (("p50", 1.2), ("p99", 1.5))]
        found.append((f"zk3 ÷ rabbitmq3 (rpc://) get {state} p50",
                      zk3("latency", f"get {state}", "p50"), "<=", 1.2))
    one = ("scaling", "1")
    found += [("zk ÷ rabbitmq rate, K=1", div(("zk", *one, "rate"), ("rabbitmq", *one, "rate")),
               ">=", 2.0),
              ("zk ÷ rabbitmq CPU per task, K=1", div(("zk", *one, "cpu_ms_per_task"),
                                                     ("rabbitmq", *one, "cpu_ms_per_task")),
               "<=", 1.0)]
    return found


def _line(what: str, value: float, op: str, bound: float) -> str:
    return f"  {what:46s} {value:7.3f}  (target {op} {bound})  {verdict(value, op, bound)}"


def targets(results: Results, ks: list[int]) -> list[str]:
    return [_line(what, value, op, bound) for what, value, op, bound in checks(results, ks)
            if value is not None]


def round_targets(rounds: list[Results], ks: list[int]) -> list[str]:
    """Each target's ratio within each round (its two brokers measured minutes
    apart), the median of those, and its verdict: the machine's drift between
    rounds moves both sides of a ratio taken within one."""
    per_round = [checks(results, ks) for results in rounds]
    lines = []
    for index, (what, _, op, bound) in enumerate(per_round[0]):
        values = [found[index][1] for found in per_round]
        known = [value for value in values if value is not None]
        if not known:
            continue
        mid = statistics.median(known)
        passed = sum(verdict(value, op, bound) == "PASS" for value in known)
        spread = " ".join("-" if value is None else f"{value:.2f}" for value in values)
        lines.append(f"{_line(what, mid, op, bound)}  rounds: {spread} "
                     f"({passed} of {len(known)} pass)")
    return lines


def render(results: Results, info: dict[str, Any], args: argparse.Namespace,
           rounds: list[Results] | None = None) -> str:
    """The tables (with ``rounds``: each figure the median of the rounds') and the
    targets (with ``rounds``: the median of each round's own ratio)."""
    several = rounds is not None and len(rounds) > 1
    out = ["", "Machine: " + ", ".join(f"{k}={v}" for k, v in info.items()),
           "Servers: " + "; ".join(f"{name}: {res['server']}" for name, res in results.items()),
           ""]
    if several:
        out += [f"Each figure below: the median of {len(rounds)} rounds", ""]
    if any("scaling" in res for res in results.values()):
        out += [f"Scaling: K workers -P threads -c 1, {args.tasks:,} no-op tasks stored first",
                *scaling(results, args.ks), ""]
    if any("single" in res for res in results.values()):
        out += [f"One worker, {args.single_tasks:,} tasks", *single(results), ""]
    latency = {name: res["latency"] for name, res in results.items() if "latency" in res}
    if latency:
        out += [render_latency(latency, args.load), ""]
    if several:
        lines = round_targets(rounds, args.ks)
        heading = f"Issue 60 targets (median of the {len(rounds)} rounds' own ratios):"
    else:
        lines, heading = targets(results, args.ks), "Issue 60 targets:"
    if lines:
        out += [heading, *lines]
    return "\n".join(out)
