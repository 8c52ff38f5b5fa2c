"""workers.py's pure parts: the cross-process tally and the options."""
from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def benchmarks() -> Iterator[None]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield
    finally:
        sys.path.remove(str(BENCHMARKS))


def _run(path: str, indexes: list[int]) -> None:
    from tally import record
    for index in indexes:
        record(path, index)


def test_tally_counts_tasks_of_many_processes(benchmarks: None, tmp_path: Path) -> None:
    from tally import Tally
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
    from tally import Tally
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
    assert (args.ks, args.tasks, args.single_tasks, args.samples) == ([1, 4, 16], 6000, 3000, 200)
    assert args.brokers == ["zk", "redis", "rabbitmq"]
    assert args.only == ["scaling", "single", "latency"]
    quick = workers.parse_args(["--quick", "--ks", "1", "--brokers", "zk",
                                "--zk-option", "handoff=false"])
    assert (quick.ks, quick.tasks, quick.brokers) == ([1], 600, ["zk"])
    assert quick.zk_option == ["handoff=false"]
    with pytest.raises(SystemExit):
        workers.parse_args(["--only", "drain"])
