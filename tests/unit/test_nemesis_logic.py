"""The nemesis's pure parts: its plan, its journals, its checker and its recovery figures.

The harness itself (namespaces, an ensemble, workers) is run by
``tests/integration/test_nemesis.py``.
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def nemesis() -> Iterator[dict[str, ModuleType]]:
    sys.path.insert(0, str(BENCHMARKS))   # the import root of the nemesis package
    try:
        from nemesis import checker, history, recovery, schedule
        yield {"checker": checker, "history": history, "recovery": recovery,
               "schedule": schedule}
    finally:
        sys.path.remove(str(BENCHMARKS))


ZK, WORKERS = ["zk1", "zk2", "zk3"], ["w1", "w2", "w3"]


def test_a_seed_makes_one_plan(nemesis: dict[str, ModuleType]) -> None:
    plan = nemesis["schedule"].plan
    assert plan(7, 600, ZK, WORKERS) == plan(7, 600, ZK, WORKERS)
    assert plan(7, 600, ZK, WORKERS) != plan(8, 600, ZK, WORKERS)


def test_the_long_plan_fits_its_time_one_fault_at_a_time(nemesis: dict[str, ModuleType]
                                                          ) -> None:
    schedule = nemesis["schedule"]
    faults = schedule.plan(3, 1800, ZK, WORKERS)
    assert len(faults) > 30
    assert faults[-1].at + faults[-1].duration <= 1800
    for before, after in zip(faults, faults[1:]):
        assert after.at - (before.at + before.duration) >= schedule.GAP_LONG[0] - 0.1
    targets = {f.target for f in faults}
    assert {"leader", "dispatcher"} <= targets   # the favoured targets
    for fault in faults:
        if fault.kind.startswith("pause"):
            assert fault.duration > 10   # past celery_zk's default session timeout
        if fault.kind == "partition-split":
            assert len(set(fault.minority) & set(ZK)) == 1   # the majority keeps a quorum
            assert set(fault.minority) & set(WORKERS)


def test_the_short_plan_has_every_kind_once(nemesis: dict[str, ModuleType]) -> None:
    schedule = nemesis["schedule"]
    faults = schedule.plan(1, float("inf"), ZK, WORKERS, short=True)
    assert sorted(f.kind for f in faults) == sorted(schedule.KINDS)
    assert 90 < schedule.short_seconds(ZK, WORKERS, 1) < 160


def test_a_journal_keeps_whole_lines_only(nemesis: dict[str, ModuleType],
                                          tmp_path: Path) -> None:
    history = nemesis["history"]
    journal = history.Journal(history.exec_journal(str(tmp_path), "w1"))
    journal.write(e="start", id="a")
    follower = history.Follower(str(tmp_path))
    assert [e["id"] for e in follower.new_entries()] == ["a"]
    with open(journal.path, "ab") as fh:
        fh.write(b'{"e":"end","id":"a"')   # a writer killed mid-line
    assert follower.new_entries() == []
    assert [e["e"] for e in history.read_executions(str(tmp_path))] == ["start"]
    journal.write(e="end", id="b")
    journal.close()
    # The cut line is joined to the next one: a reader skips what does not parse whole.
    assert history.read_journal(str(tmp_path / "missing.jsonl")) == []


def test_a_requeued_message_is_the_same_message(nemesis: dict[str, ModuleType]) -> None:
    identity = nemesis["checker"].message_identity
    first = identity("n8-0000000000-2618ea8b75ad4d22-0000000004")
    again = identity("n8-0000000000-2618ea8b75ad4d22-r0000000004")
    other = identity("n8-0000000000-3618ea8b75ad4d22-0000000004")
    assert first == again != other


def _execution(task_id: str, host: str, t: float, tag: str, redelivered: bool = False,
               pid: int = 1, end: bool = True) -> list[dict[str, Any]]:
    start = {"e": "start", "id": task_id, "host": host, "pid": pid, "t": t, "tag": tag,
             "redelivered": redelivered}
    return [start, {**start, "e": "end", "t": t + 0.01}] if end else [start]


TAG = "n9-0000000000-aaaa-0000000001"
REQUEUED = "n9-0000000000-aaaa-r0000000001"
SECOND = "n9-0000000000-bbbb-0000000002"


def _check(nemesis: dict[str, ModuleType], publisher: list[dict[str, Any]],
           executions: list[dict[str, Any]], faults: list[dict[str, Any]] = (),  # type: ignore
           results: dict[str, str | None] | None = None) -> dict[str, Any]:
    checker = nemesis["checker"]
    history = checker.History.build(publisher, sorted(executions, key=lambda e: e["t"]))
    states = results if results is not None else {i: "SUCCESS" for i in history.expected}
    return checker.check(history, states, list(faults))


def test_lost_and_unreadable_tasks_are_violations(nemesis: dict[str, ModuleType]) -> None:
    publisher = [{"e": "publish", "kind": "task", "id": i, "seq": n, "t": 1.0}
                 for n, i in enumerate("abc")]
    executions = _execution("a", "w1", 2, TAG) + _execution("b", "w1", 2, SECOND, end=False)
    report = _check(nemesis, publisher, executions,
                    results={"a": "FAILURE", "b": None, "c": None})
    assert report["lost"]["count"] == 2
    assert {e["why"] for e in report["lost"]["examples"]} == {"never started",
                                                              "started, never completed"}
    assert report["results_unreadable"]["count"] == 1


def test_why_a_task_ran_again(nemesis: dict[str, ModuleType]) -> None:
    publisher = [{"e": "publish", "kind": "task", "id": i, "seq": n, "t": 1.0}
                 for n, i in enumerate("abcdef")]
    publisher += [{"e": "retry", "ids": ["seq-3"], "t": 1.0},
                  {"e": "retry", "ids": ["seq-5"], "t": 1.0}]
    paused = [{"kind": "pause-worker", "target": "w1", "started": 1.5, "healed": 15.0}]
    executions = (
        # a: its owner paused, the message redelivered elsewhere
        _execution("a", "w1", 2, TAG) + _execution("a", "w2", 14, REQUEUED, True, pid=2)
        # b: redelivered elsewhere first; the paused owner runs its stale copy after
        + _execution("b", "w2", 12, REQUEUED, True, pid=2) + _execution("b", "w1", 16, TAG)
        # c: a second message of one task, no publish retry
        + _execution("c", "w1", 2, TAG) + _execution("c", "w2", 3, SECOND, pid=2)
        # d: the same, after a publish retry
        + _execution("d", "w1", 2, TAG) + _execution("d", "w2", 3, SECOND, pid=2)
        # e: one message twice, neither a redelivery, no publish retry
        + _execution("e", "w1", 2, TAG) + _execution("e", "w1", 3, TAG)
        # f: the same after a publish retry (a hand-off's lost reply, acked first)
        + _execution("f", "w1", 2, TAG) + _execution("f", "w1", 3, TAG))
    report = _check(nemesis, publisher, executions, paused)
    assert report["duplicated"]["why"] == {
        "redelivered: owner paused": 1,
        "stale copy run by its lost owner: owner paused": 1,
        "a second message without a publish retry": 1,
        "publish retry: a second message": 1,
        "the same message delivered twice, neither time redelivered": 1,
        "publish retry after a lost reply: the same message stored again": 1}
    assert report["violations"] == [
        "task c ran again: a second message without a publish retry",
        "task e ran again: the same message delivered twice, neither time redelivered"]
    # Without the fault nothing took the owner: a redelivery is then unexplained.
    bare = _check(nemesis, publisher[:1], executions[:4])
    assert bare["violations"] == ["task a ran again: redelivered, but no fault took its owner"]
    # A split whose minority holds a server: an owner on the majority side may
    # have been connected to that server (the nemesis saw a session expire so).
    split = [{"kind": "partition-split", "target": "zk1", "minority": ["w2", "zk1"],
              "started": 1.5, "healed": 15.0}]
    report = _check(nemesis, publisher[:1], executions[:4], split)
    assert report["violations"] == []
    assert report["duplicated"]["why"] == {"redelivered: owner's server on the minority side": 1}


def test_a_revoked_task_must_not_start_after_the_revoke(nemesis: dict[str, ModuleType]) -> None:
    publisher = [{"e": "publish", "kind": "revoke", "id": i, "seq": n, "t": 1.0, "due": 9.0}
                 for n, i in enumerate("ab")]
    publisher += [{"e": "revoke", "id": "a", "t": 2.0}, {"e": "revoke", "id": "b", "t": 2.0}]
    executions = _execution("a", "w1", 9, TAG) + _execution("b", "w2", 9, SECOND)
    checker = nemesis["checker"]
    history = checker.History.build(publisher, executions)
    results = {"a": "SUCCESS", "b": "REVOKED"}
    report = checker.check(history, results, [])
    assert report["revokes"]["count"] == 2
    assert [v["id"] for v in report["revokes"]["violations"]] == ["a", "b"]
    assert report["lost"]["count"] == 0   # a revoked task need not run
    # What the workers' logs say they heard, and when: b's revoke arrived as it started.
    report = checker.check(history, results, [], heard={"w1": {}, "w2": {"b": 8.5}})
    assert [(v["id"], v["why"]) for v in report["revokes"]["violations"]] == [
        ("a", "its worker never got the broadcast")]
    assert report["revokes"]["raced_the_broadcast"] == 1
    report = checker.check(history, results, [], deaf={"w1"}, heard={"w2": {"b": 1.0}})
    assert [v["why"] for v in report["revokes"]["violations"]] == [
        checker.DEAF, "its worker had the broadcast"]


def test_a_chord_body_runs_after_its_parts(nemesis: dict[str, ModuleType]) -> None:
    publisher = [{"e": "publish", "kind": "chord", "id": "body", "seq": 1, "t": 1.0,
                  "parts": ["p1", "p2"], "group": "g"}]
    executions = (_execution("p1", "w1", 2, TAG) + _execution("p2", "w2", 5, SECOND)
                  + _execution("body", "w1", 3, "n9-0000000000-cccc-0000000003"))
    report = _check(nemesis, publisher, executions)
    assert report["chords"]["count"] == 1
    assert "ran before parts ['p2']" in report["chords"]["violations"][0]["why"]


def test_recovery_is_measured_from_the_heal(nemesis: dict[str, ModuleType]) -> None:
    recovery = nemesis["recovery"]
    # 10 tasks/s, none completed between 100 and 110, then 10/s again.
    completions = [t / 10 for t in range(0, 1000)] + [110 + t / 10 for t in range(300)]
    assert recovery.recover_after(50.0, 140, completions, 10.0) == 0.0
    took = recovery.recover_after(105.0, 140, completions, 10.0)
    assert took is not None and 7.0 <= took <= 8.0   # 80% of a 3 s window: 2.4 s after 110
    assert recovery.recover_after(105.0, 109, completions, 10.0) is None
    due_and_done = [(1.0, 2.0), (104.0, 112.5), (120.0, None)]
    assert recovery.caught_up_after(105.0, 140, due_and_done) == 7.5
    assert recovery.caught_up_after(121.0, 140, due_and_done) is None


def test_a_task_never_completed_does_not_break_the_catch_up_measure(
        nemesis: dict[str, ModuleType]) -> None:
    """A chord's body and its parts share a publish time; a lost body (never
    completed) must sort among them, not crash the report (it did)."""
    checker = nemesis["checker"]
    publisher = [{"e": "publish", "kind": "chord", "id": "body", "seq": 1, "t": 1.0,
                  "parts": ["p1", "p2"], "group": "g"}]
    executions = _execution("p1", "w1", 2, TAG) + _execution("p2", "w2", 3, SECOND)
    history = checker.History.build(publisher, executions)
    assert history.due_and_done() == [(1.0, 2.01), (1.0, 3.01), (1.0, None)]
