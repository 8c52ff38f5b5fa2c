"""The benchmarks' pure parts: the cross-process tally, percentiles, verdicts and
workers.py's options and report. The benchmarks themselves are run by hand
(benchmarks/README.md), never as tests."""
from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def benchmarks() -> Iterator[None]:
    """benchmarks/ on sys.path: it is the import root of its scripts and packages."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield
    finally:
        sys.path.remove(str(BENCHMARKS))


def _run(path: str, indexes: list[int]) -> None:
    from common.tally import record
    for index in indexes:
        record(path, index)


def test_tally_counts_tasks_of_many_processes(benchmarks: None, tmp_path: Path) -> None:
    from common.tally import Tally
    tally = Tally(str(tmp_path / "t"), 10)
    assert not tally.started() and not tally.done()
    ctx = multiprocessing.get_context("fork")   # as a prefork pool makes its children
    procs = [ctx.Process(target=_run, args=(tally.path, part))
             for part in ([0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 9])]   # 9 twice: a redelivery
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        assert proc.exitcode == 0
    assert tally.started() and tally.done()
    summary = tally.summary()
    assert (summary.executions, summary.distinct, summary.processes) == (11, 10, 3)
    assert summary.first <= summary.last
    tally.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]   # slot files removed


def test_tally_is_not_done_until_every_index_ran(benchmarks: None, tmp_path: Path) -> None:
    from common.tally import Tally
    tally = Tally(str(tmp_path / "t"), 3)
    proc = multiprocessing.get_context("fork").Process(target=_run, args=(tally.path, [0, 2]))
    proc.start()
    proc.join()
    assert tally.started() and not tally.done()
    assert tally.summary().distinct == 2
    tally.close()


def test_workers_options(benchmarks: None) -> None:
    import workers
    args = workers.parse_args([])
    assert (args.ks, args.tasks, args.single_tasks, args.samples) == ([1, 4, 16], 20000, 10000, 200)
    assert args.brokers == ["zk", "redis", "rabbitmq"]
    assert args.only == ["scaling", "single", "latency"]
    quick = workers.parse_args(["--quick", "--ks", "1", "--brokers", "zk",
                                "--zk-option", "handoff=false"])
    assert (quick.ks, quick.tasks, quick.brokers) == ([1], 600, ["zk"])
    assert quick.zk_option == ["handoff=false"]
    with pytest.raises(SystemExit):
        workers.parse_args(["--only", "drain"])


def test_workers_rounds_report_medians_and_each_rounds_own_ratio(benchmarks: None) -> None:
    import workers
    from common.report import median_of, render, round_targets

    assert workers.parse_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        workers.parse_args(["--rounds", "0"])

    def results(zk: float, rabbit: float, rabbit3: float) -> dict:
        return {"zk3": {"server": "zk 3.8", "scaling": {"4": {"rate": zk, "attempt": 1}}},
                "rabbitmq3": {"server": "RabbitMQ", "scaling": {"4": {"rate": rabbit3}}},
                "rabbitmq": {"server": "RabbitMQ", "scaling": {"4": {"rate": rabbit}}}}

    # The machine drifts: round 2 runs everything at half speed.
    rounds = [results(900, 1000, 300), results(450, 500, 600), results(800, 1000, 700)]
    merged = median_of(rounds)
    assert merged["zk3"]["scaling"]["4"] == {"rate": 800, "attempt": 1}
    assert merged["zk3"]["server"] == "zk 3.8"
    assert median_of([{"a": None}, {"a": 2.0}]) == {"a": 2.0}
    assert median_of([{"a": None}]) == {"a": None}

    lines = round_targets(rounds, [4])
    by_what = {line.split("  ")[1].strip(): line for line in lines}
    # zk3 ÷ rabbitmq3 within each round: 3.0, 0.75, 1.14; their median 1.14 (the
    # medians' ratio, 800 / 600, would say 1.33).
    line = by_what["zk3 ÷ rabbitmq3 rate, K=4"]
    assert " 1.143 " in line and "MISS" in line and "3.00 0.75 1.14 (1 of 3 pass)" in line
    args = workers.parse_args(["--ks", "4", "--rounds", "3", "--only", "scaling"])
    text = render(merged, {"nproc": 2}, args, rounds)
    assert "the median of 3 rounds" in text and "rounds' own ratios" in text


def test_percentile_nearest_rank(benchmarks: None) -> None:
    from common.figures import percentile
    values = [float(v) for v in range(1, 201)]
    assert percentile(values, 50) == 100.0
    assert percentile(values, 99) == 198.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_verdict_bounds_are_inclusive(benchmarks: None) -> None:
    from common.report import verdict
    assert verdict(2.0, "<=", 2.0) == "PASS"
    assert verdict(2.01, "<=", 2.0) == "MISS"
    assert verdict(1.0, ">=", 1.0) == "PASS"
    assert verdict(0.99, ">=", 1.0) == "MISS"
