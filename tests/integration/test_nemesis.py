"""The nemesis's short mode: every fault kind once on a real ensemble, nothing lost.

Runs ``benchmarks/nemesis --short`` (2-4 minutes: network namespaces, a
three-member ensemble, three ``celery worker`` hosts, a steady publisher;
see docs/nemesis.md) and asserts what its checker found. Needs root, for the
namespaces.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEMESIS = ROOT / "benchmarks" / "nemesis"   # a package, run as a directory
SEED = int(os.environ.get("CELERY_ZK_NEMESIS_SEED", "27"))
#: Before pytest's own timeout (below), so a hung run's output is shown.
RUN_TIMEOUT = 600


def run_short(tmp_path: Path) -> dict[str, Any]:
    report = tmp_path / "nemesis.json"
    try:
        done = subprocess.run(
            [sys.executable, str(NEMESIS), "--short", "--seed", str(SEED), "--json",
             str(report), "--work-dir", str(tmp_path / "run")],
            capture_output=True, text=True, timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired as exc:   # what it printed: where it hung
        out, err = (text.decode() if isinstance(text, bytes) else text or ""
                    for text in (exc.stdout, exc.stderr))
        pytest.fail(f"the short nemesis ran over {RUN_TIMEOUT}s (2-4 minutes as a "
                    f"rule):\n{out[-4000:]}\n{err[-8000:]}")
    print(done.stdout[-4000:])
    assert report.exists(), f"no report (exit {done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(report.read_text())


def trace(run_dir: Path, lost: list[dict[str, Any]], most: int = 120) -> str:
    """Every line of the run's journals and logs that names a lost task, or for
    a chord's body its chord's parts (the run's directory goes with pytest's
    temporary ones: on CI this message is all that is left of a rare loss)."""
    ids = {entry["id"] for entry in lost}
    publisher = run_dir / "publisher.jsonl"
    if publisher.exists():
        for line in publisher.read_text(errors="replace").splitlines():
            if '"parts"' in line and any(task_id in line for task_id in ids):
                entry = json.loads(line)
                ids.update(entry.get("parts", []))
                ids.add(entry.get("group", ""))
    ids.discard("")
    lines = []
    for path in sorted(run_dir.glob("*.jsonl")) + sorted(run_dir.glob("*.log")):
        if path.name.startswith("zk"):
            continue   # the servers' logs name no task
        for line in path.read_text(errors="replace").splitlines():
            if any(task_id in line for task_id in ids):
                lines.append(f"{path.name}: {line[:400]}")
    shown = "\n".join(lines[:most])
    more = f"\n... and {len(lines) - most} more" if len(lines) > most else ""
    return f"the lines naming {sorted(ids)}:\n{shown}{more}"


def left_behind() -> list[str]:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line for line in namespaces.splitlines() if line.startswith("czkn-")]


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="the nemesis makes network namespaces: needs root and iproute2")
def test_the_short_nemesis_loses_nothing(tmp_path: Path, record_property: Any) -> None:
    result = run_short(tmp_path)
    for key in ("published", "executed", "lost", "duplicated", "stuck", "faults", "seed"):
        assert key in result, key
        record_property(key, json.dumps(result[key])[:2000])
    kinds = {fault["kind"] for fault in result["faults"]}
    assert len(kinds) == 7, kinds   # every kind of fault happened
    assert result["published"] > 1000
    lost = result["lost"]
    if lost["count"]:
        pytest.fail(f"lost: {lost}\n{trace(tmp_path / 'run', lost['examples'])}")
    assert result["stuck"]["count"] == 0, result["stuck"]
    assert result["results_unreadable"]["count"] == 0, result["results_unreadable"]
    assert result["chords"]["violations"] == [], result["chords"]
    assert result["consistency"]["consistent"], result["consistency"]
    recovery = [(f["kind"], f["recover_s"], f["caught_up_s"]) for f in result["faults"]]
    assert all(caught_up is not None for _, _, caught_up in recovery), recovery
    assert left_behind() == []
    # B1-B4 (docs/nemesis.md) are fixed: every violation fails the test.
    assert result["violations"] == [], result["violations"]
