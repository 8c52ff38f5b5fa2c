"""Cluster-wide rate and concurrency limits (issue 29), on a real server with
real workers (threads and prefork), workers added and killed meanwhile."""
from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_zk.exceptions import ZKConfigurationError
from celery_zk.features.limit_gate import GIVE_MARGIN, START_MARGIN, Gate
from celery_zk.features.limits import Limit, parse_rate
from celery_zk.zk.message_names import message_prefix, parse_message_name, task_token

from .workers import Worker, celery_cli, read_log, wait_until

TIMED = "proj.app.timed"


def _load_spans() -> Any:
    """benchmarks/common/spans.py, which benchmarks/limits.py counts with too (by
    path: it needs nothing else of benchmarks/)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "common" / "spans.py"
    spec = importlib.util.spec_from_file_location("celery_zk_bench_spans", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_spans = _load_spans()
most_in_any_window = _spans.most_in_any_window
most_at_once = _spans.most_at_once


@pytest.fixture
def app(zk_url: str) -> Iterator[Celery]:
    client_app = Celery("limits", broker=zk_url, set_as_current=False)
    yield client_app
    client_app.close()


def runs(task_log: Path) -> list[dict[str, Any]]:
    return [entry["value"] for entry in read_log(task_log) if entry["kind"] == "timed"]


def wait_for_limit(zk_url: str, task: str = TIMED) -> None:
    def there() -> bool:
        listed = celery_cli(["zk", "limit", "list", "--json"], zk_url)
        return listed.returncode == 0 and task in listed.stdout
    wait_until(there, 30, 0.5, message="the workers did not write their limits")


def test_rates_parse_as_celery_writes_them() -> None:
    assert parse_rate("20/m") == (20, 60.0)
    assert parse_rate("5/s") == (5, 1.0) and parse_rate("5") == (5, 1.0)
    assert parse_rate("0.5/s") == (1, 2.0)
    assert parse_rate("100/h") == (100, 3600.0)
    for bad in ("fast", "0/s", "-1/m", "3/week", "nan/s"):
        with pytest.raises(ZKConfigurationError, match="rate"):
            parse_rate(bad)
    with pytest.raises(ZKConfigurationError, match="at least 1"):
        Limit("t", "x", concurrency=0)


def test_the_gate_holds_what_is_over_and_lets_the_rest_by() -> None:
    limited, other = task_token("limited"), task_token("other")

    def name(task: str, seq: int, key: str | None = None) -> Any:
        return parse_message_name(message_prefix(9, 0, f"{seq:x}", task=task,
                                                 limit_key=key) + f"{seq:010d}")

    gate = Gate([Limit("t", "limited", rate="2/s")], "q", owned=[],
                given={("t", "limited"): [99.5]}, now=100.0)
    admitted = [gate.admit(name(t, i)) for i, t in enumerate([limited, other, limited,
                                                               limited, other])]
    assert admitted == [True, True, False, False, True]   # 1 left in the window
    assert gate.retry_in is not None and 0 < gate.retry_in <= 0.5 + GIVE_MARGIN
    gate = Gate([Limit("t", "limited", concurrency=1, key="{0}")], "q",
                owned=[name(limited, 1, "aaaaaaaa")], given={}, now=0)
    assert [gate.admit(name(limited, 2, k)) for k in ("aaaaaaaa", "bbbbbbbb", "bbbbbbbb")] \
        == [False, True, False]


def test_gives_never_outpace_what_starts_allow() -> None:
    """Over a long backlog the dispatcher gives no faster than workers may start:
    starts count a window START_MARGIN longer, and were gives as fast, tasks
    waiting for their start would pile up in the pool's slots and hold up the
    unlimited tasks behind them (seen in benchmarks/limits.py)."""
    token = task_token("limited")
    count, seconds = 20, 1.0
    given: dict[tuple[str, str], list[float]] = {}
    gives: list[float] = []
    now = 1000.0
    while now < 1030.0:   # a dispatcher round every 5 ms, 30 s of backlog
        gate = Gate([Limit("t", "limited", rate=f"{count}/s")], "q", owned=[],
                    given=given, now=now)
        seq = len(gives)
        while gate.admit(parse_message_name(message_prefix(9, 0, f"{seq:x}", task=token)
                                            + f"{seq:010d}")):
            gives.append(now)
            seq += 1
        for limit, times in gate.records():
            given[(limit.kind, limit.name)] = times
        now += 0.005
    window = seconds + START_MARGIN
    most = max(sum(1 for t in gives if start <= t < start + window) for start in gives)
    assert most <= count
    assert len(gives) >= 30 * count * seconds / (seconds + GIVE_MARGIN) - count


@pytest.mark.slow
def test_a_rate_limit_holds_across_workers_added_and_killed(
        app: Celery, start_worker: Callable[..., Worker], zk_url: str,
        task_log: Path) -> None:
    """5/s on one task across three workers (threads and prefork, one killed
    and one added meanwhile): at most 5 start in any second; the other tasks of
    the queue are not held up behind them."""
    conf = json.dumps({"zk_rate_limits": {TIMED: "5/s"}})
    env = {"CELERY_ZK_TEST_CONF": conf}
    a = start_worker(zk_url, log=task_log, name="a", concurrency=2, env=env)
    start_worker(zk_url, log=task_log, name="b", pool="prefork", concurrency=2, env=env)
    wait_for_limit(zk_url)
    limited = [app.send_task(TIMED, args=(i,)) for i in range(40)]
    others = [app.send_task("proj.app.record", args=(f"free-{i}",)) for i in range(100)]
    wait_until(lambda: {f"free-{i}" for i in range(100)} <= {
        e["value"] for e in read_log(task_log) if e["kind"] == "record"}, 30,
        message="the unlimited tasks were held up")
    assert len(runs(task_log)) < 40   # the limited ones still trickle
    a.kill()
    start_worker(zk_url, log=task_log, name="c", concurrency=2, env=env)
    wait_until(lambda: len({r["value"] for r in runs(task_log)}) == 40, 60,
               message="not every limited task ran")
    starts = [r["start"] for r in runs(task_log)]
    assert most_in_any_window(starts, 1.0) <= 5, sorted(starts)
    assert limited and others


@pytest.mark.slow
def test_a_concurrency_limit_per_task_and_per_key(
        app: Celery, start_worker: Callable[..., Worker], zk_url: str,
        task_log: Path) -> None:
    """At most 1 per customer (so 2 at once in all) over a threads and a prefork
    worker; the one running the first task is killed midway (its slot comes
    back when its session ends, and the task runs again elsewhere) and a third
    worker is added: every task completes, and no window ever had more."""
    conf = {"zk_concurrency_limits": {TIMED: {"limit": 1, "key": "{2}"}}}
    env = {"CELERY_ZK_TEST_CONF": json.dumps(conf)}
    a = start_worker(zk_url, log=task_log, name="a", concurrency=2, env=env)
    b = start_worker(zk_url, log=task_log, name="b", pool="prefork", concurrency=2, env=env)
    wait_for_limit(zk_url)   # written by the workers; the publisher fills its key
    for i in range(12):
        app.send_task(TIMED, args=(i, 0.4, "acme" if i % 2 else "globex"))

    def started() -> list[dict[str, Any]]:
        return [{**e["value"], "pid": e["pid"]} for e in read_log(task_log)
                if e["kind"] == "timed-start"]
    wait_until(lambda: started(), 30, 0.02, message="no task started")
    victim = a if started()[0]["pid"] == a.pid else b   # a's pid runs its threads
    victim.kill()   # its whole process group: the worker and its pool children
    killed_at = time.time()
    start_worker(zk_url, log=task_log, name="c", concurrency=2, env=env)
    wait_until(lambda: {r["value"] for r in runs(task_log)} == set(range(12)), 90,
               message="not every task ran")
    ended = {(e["value"]["value"], e["pid"]) for e in read_log(task_log)
             if e["kind"] == "timed"}
    killed = [s for s in started() if (s["value"], s["pid"]) not in ended]
    assert killed, "the killed worker was running none"
    spans = [(r["start"], r["end"], r["customer"]) for r in runs(task_log)]
    spans += [(s["start"], killed_at, s["customer"]) for s in killed]
    for customer in ("acme", "globex"):
        mine = [(start, end) for start, end, who in spans if who == customer]
        assert most_at_once(mine) == 1, mine
    assert most_at_once([(start, end) for start, end, _ in spans]) <= 2


@pytest.mark.slow
def test_a_limit_changed_at_run_time_takes_effect_without_a_restart(
        app: Celery, start_worker: Callable[..., Worker], zk_url: str,
        task_log: Path) -> None:
    start_worker(zk_url, log=task_log, name="a", concurrency=4)
    setting = celery_cli(["zk", "limit", "set", TIMED, "--concurrency", "1"], zk_url)
    assert setting.returncode == 0, setting.stderr
    for i in range(6):
        app.send_task(TIMED, args=(i, 0.3))
    wait_until(lambda: len(runs(task_log)) == 6, 60)
    assert most_at_once([(r["start"], r["end"]) for r in runs(task_log)]) == 1
    listed = celery_cli(["zk", "limit", "list", "--json"], zk_url)
    assert json.loads(listed.stdout)[0]["concurrency"] == 1
    status = celery_cli(["zk", "status"], zk_url)
    assert "RUNNING/LIMIT" in status.stdout and TIMED in status.stdout
    cleared = celery_cli(["zk", "limit", "clear", TIMED], zk_url)
    assert cleared.returncode == 0, cleared.stderr
    for i in range(6, 14):
        app.send_task(TIMED, args=(i, 0.3))
    wait_until(lambda: len(runs(task_log)) == 14, 60)
    later = [(r["start"], r["end"]) for r in runs(task_log) if r["value"] >= 6]
    assert most_at_once(later) >= 2   # no limit any more: the four threads share them
    bad = celery_cli(["zk", "limit", "set", TIMED, "--rate", "fast"], zk_url)
    assert bad.returncode != 0 and "not a rate" in bad.stderr


EARLY = "proj.app.timed_early"   # timed, acked as it starts (Celery's default)


@pytest.mark.slow
def test_a_concurrency_limit_holds_tasks_that_ack_early(
        app: Celery, start_worker: Callable[..., Worker], zk_url: str,
        task_log: Path) -> None:
    """Celery's default early ack: a task holds its slot from its start to its
    end all the same (three workers, threads and prefork, never more than 2)."""
    env = {"CELERY_ZK_TEST_CONF": json.dumps({"zk_concurrency_limits": {EARLY: 2}})}
    start_worker(zk_url, log=task_log, name="a", concurrency=2, env=env)
    start_worker(zk_url, log=task_log, name="b", pool="prefork", concurrency=2, env=env)
    start_worker(zk_url, log=task_log, name="c", concurrency=2, env=env)
    wait_for_limit(zk_url, EARLY)
    for i in range(8):
        app.send_task(EARLY, args=(i, 0.8))
    wait_until(lambda: sorted(r["value"] for r in runs(task_log)) == list(range(8)), 90,
               message="not every task ran once")
    assert most_at_once([(r["start"], r["end"]) for r in runs(task_log)]) == 2


@pytest.mark.slow
def test_an_early_acked_tasks_slot_goes_with_its_workers_session(
        app: Celery, start_worker: Callable[..., Worker], zk_url: str,
        task_log: Path, zk_client: Any) -> None:
    """A worker killed while it runs an early-acked task: the task is not run
    again (it was acked), and its slot goes when the worker's session ends,
    so the next tasks run elsewhere."""
    env = {"CELERY_ZK_TEST_CONF": json.dumps({"zk_concurrency_limits": {EARLY: 1}})}
    url = f"{zk_url}?session_timeout=4"
    a = start_worker(url, log=task_log, name="a", concurrency=2, env=env)
    wait_for_limit(zk_url, EARLY)
    for i in range(4):
        app.send_task(EARLY, args=(i, 1.5))
    def slots() -> list[str]:
        inboxes = "/queues/celery/owned"
        return [name for inbox in zk_client.get_children(inboxes)
                for name in zk_client.get_children(f"{inboxes}/{inbox}") if name[0] == "~"]
    # Its early ack landed: the running task's slot is there (killed sooner, its
    # message would go back and run again, at-least-once).
    wait_until(lambda: len(slots()) == 1, 30)
    a.kill()
    first = next(e["value"]["value"] for e in read_log(task_log)
                 if e["kind"] == "timed-start")
    start_worker(url, log=task_log, name="b", concurrency=2, env=env)
    rest = sorted(set(range(4)) - {first})
    wait_until(lambda: sorted(r["value"] for r in runs(task_log)) == rest, 60,
               message="the dead worker's slot was never released")
    assert most_at_once([(r["start"], r["end"]) for r in runs(task_log)]) == 1
    assert first not in [r["value"] for r in runs(task_log)]   # acked: not run again
    owned = zk_client.get_children("/queues/celery/owned")
    assert not [name for inbox in owned
                for name in zk_client.get_children(f"/queues/celery/owned/{inbox}")]
