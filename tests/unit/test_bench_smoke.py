"""The benchmark script's pure logic: argument defaults, percentiles, verdicts.

The benchmark itself is run by hand (``benchmarks/bench.py``), never as a test.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("celery_zk_bench", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        if str(BENCH.parent) in sys.path:
            sys.path.remove(str(BENCH.parent))


def sibling(name: str) -> ModuleType:
    """A module of benchmarks/ that the scripts import by name (common, bench_report)."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH.parent))


def test_percentile_nearest_rank() -> None:
    percentile = sibling("common").percentile
    values = [float(v) for v in range(1, 201)]
    assert percentile(values, 50) == 100.0
    assert percentile(values, 99) == 198.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_verdict_bounds_are_inclusive() -> None:
    verdict = sibling("bench_report").verdict
    assert verdict(2.0, "<=", 2.0) == "PASS"
    assert verdict(2.01, "<=", 2.0) == "MISS"
    assert verdict(1.0, ">=", 1.0) == "PASS"
    assert verdict(0.99, ">=", 1.0) == "MISS"


def test_defaults_and_quick(bench: ModuleType) -> None:
    args = bench.parse_args([])
    assert (args.tasks, args.latency_samples, args.publish) == (5000, 200, 2000)
    assert args.zk_force_sync == "yes" and args.only == ["zk", "redis", "kombu-zk"]
    quick = bench.parse_args(["--quick", "--only", "zk,redis", "--zk-force-sync", "no"])
    assert quick.tasks < 5000 and quick.only == ["zk", "redis"]
    assert bench.plan(args, "kombu-zk")[0] == bench.KOMBU_ZK_LATENCY_SAMPLES
    assert bench.plan(args, "zk") == (200, 5000)


def test_unknown_broker_is_an_error(bench: ModuleType) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "rabbit"])


def test_render_marks_targets(bench: ModuleType) -> None:
    results = {"zk": {"latency_p50": 5.0, "drain_rate": 900.0, "publish_rate": 800.0},
               "redis": {"latency_p50": 2.0, "drain_rate": 1000.0},
               "kombu-zk": {"publish_rate": 700.0}}
    text, verdicts = bench.render(results, {"nproc": 2}, ["a note"])
    by_target = {v["target"]: v["verdict"] for v in verdicts}
    assert by_target == {"round-trip p50: zk / redis": "MISS",
                         "drain rate: zk / redis": "MISS",
                         "publish rate: zk / kombu-zk": "PASS"}
    assert "not measured" in text and "a note" in text


def test_render_reports_the_floor_under_latency_targets(bench: ModuleType) -> None:
    results = {"zk": {"latency_p50": 9.0, "result_p50": 8.0},
               "redis": {"latency_p50": 3.0, "result_p50": 4.0},
               "zk-floor": {"latency_p50": 7.0, "result_p50": 6.0}}
    text, verdicts = bench.render(results, {"nproc": 2}, [])
    floors = {v["target"]: round(v["floor_ratio"], 2) for v in verdicts if "floor_ratio" in v}
    assert floors == {"round-trip p50: zk / redis": 2.33,
                      "result round-trip p50: zk / redis": 1.5}
    assert "unreachable on this machine" in text and "below the target" in text
    assert text.index("zk-floor") > text.index("redis")  # the floor row comes last


def test_floor_rejects_an_unknown_mode() -> None:
    sys.path.insert(0, str(BENCH.parent))
    try:
        from floor import measure
        with pytest.raises(ValueError, match="mode must be one of"):
            measure("127.0.0.1:1", "fast", 1)
    finally:
        sys.path.remove(str(BENCH.parent))


def load_timeline() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "celery_zk_timeline", BENCH.parent / "timeline.py")
    assert spec and spec.loader
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)
    sys.path.remove(str(BENCH.parent))
    return timeline


def test_timeline_takes_each_step_after_the_one_before(tmp_path: Path) -> None:
    timeline = load_timeline()
    steps = [(role, step) for role, step, _ in timeline.STEPS]
    marks = tmp_path / "marks.txt"
    lines = []
    for trip in range(3):   # the first is a warm-up
        start = 10.0 * trip
        # The client's consuming thread runs once before the reply is there:
        # that early pass must not count as the step after the reply's watch.
        lines.append(f"{start + 0.0031:.7f} client get\n")
        for i, (role, step) in enumerate(steps):
            lines.append(f"{start + 0.001 * i:.7f} {role} {step}\n")
    marks.write_text("".join(reversed(lines)))   # two processes: not in time order
    rows = timeline.timeline(str(marks), warm_up=1)
    by_step = {(role, step): (offset, gap, n) for role, step, _, offset, gap, n in rows}
    for i, key in enumerate(steps):
        offset, gap, n = by_step[key]
        assert n == 2
        assert offset == pytest.approx(1.0 * i)
        assert gap == pytest.approx(0.0 if i == 0 else 1.0)


def test_timeline_a_step_may_come_before_the_mark_of_the_write_that_caused_it(
        tmp_path: Path) -> None:
    """The writer marks ``sent`` as its write returns; preempted there, it marks
    it after the worker's watch has reported the write. The trip's later steps
    still count, not the next report (the ack's, after all of them)."""
    timeline = load_timeline()
    steps = [(role, step) for role, step, _ in timeline.STEPS]
    sent, tree = steps.index(("client", "sent")), steps.index(("worker", "tree"))
    lines = []
    for trip in range(3):   # the first is a warm-up
        start = 10.0 * trip
        for i, (role, step) in enumerate(steps):
            at = start + 0.001 * i
            if i == sent:
                at = start + 0.001 * (tree + 0.5)   # after the report it caused
            lines.append(f"{at:.7f} {role} {step}\n")
        lines.append(f"{start + 0.001 * (len(steps) + 1):.7f} worker tree\n")   # the ack's
    marks = tmp_path / "marks.txt"
    marks.write_text("".join(lines))
    rows = timeline.timeline(str(marks), warm_up=1)
    assert {(role, step): n for role, step, _, _, _, n in rows} == {key: 2 for key in steps}


def test_timeline_hooks_find_the_steps_they_wrap() -> None:
    """marks.install() wraps celery_zk's methods by name: a step renamed or
    removed must fail here, not leave timeline.py measuring nothing (its
    hooks once named the claim steps of before 0.2 for months)."""
    import subprocess
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import marks; marks.install(); "
            "from celery_zk.broker import inbox; assert inbox.Inbox.take.__wrapped__")
    done = subprocess.run([sys.executable, "-c", code, str(BENCH.parent)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_give_back_compares_two_ways_of_the_same_choice() -> None:
    """benchmarks/give_back.py: its one-at-a-time reference leaves the buffer
    as Ready.latest + Ready.remove do, so the figures compare like with like."""
    spec = importlib.util.spec_from_file_location(
        "celery_zk_give_back", BENCH.parent / "give_back.py")
    assert spec is not None and spec.loader is not None
    give_back = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(give_back)
    left = []
    for way in (give_back.one_at_a_time, give_back.at_once):
        ready = give_back.fill(40)
        way(ready, 25)
        left.append([ready.pop().name for _ in range(len(ready))])
    assert left[0] == left[1] and len(left[0]) == 15
    in_order = [ready.pop().name for ready in [give_back.fill(40)] for _ in range(40)]
    assert left[0] == in_order[:15]   # the first 15 in the queue's order stay
