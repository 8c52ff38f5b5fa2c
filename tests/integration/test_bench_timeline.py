"""benchmarks/timeline.py end to end: every step's hook is passed on every round trip.

The hooks wrap celery_zk's methods by name from the outside (benchmarks/marks.py),
so a renamed method leaves its step empty without any error: timeline.py once
measured nothing for months so. Only which steps were passed is checked, never a
timing. (A trip whose writer was preempted between its write and the mark after
it once lost its later steps: timeline.py's AFTER_THE_WRITE.)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "timeline.py"
SAMPLES = 5
#: Passed only on some trips: the dispatcher's give, when a message is not handed
#: over; the client's watch on a done node, when the result was not there yet
#: as get() looked (else it is read at once).
NOT_ON_EVERY_TRIP = {"dispatch", "watch"}


def passed(output: str) -> dict[str, int]:
    """``process/step`` -> round trips that passed it, from timeline.py's table."""
    rows = [line.split() for line in output.splitlines()]
    return {f"{row[0]}/{row[1]}": int(row[4]) for row in rows
            if len(row) >= 5 and row[0] in ("client", "worker")}


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--result"]], ids=["round-trip", "result"])
def test_every_step_is_passed_on_every_round_trip(tmp_path: Path, mode: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, str(SCRIPT), "--samples", str(SAMPLES), *mode],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    counts = passed(run.stdout)
    assert counts, run.stdout
    missed = {step: n for step, n in counts.items()
              if n != SAMPLES and step.split("/")[1] not in NOT_ON_EVERY_TRIP}
    assert missed == {}, run.stdout
    if not mode:
        assert {"client/put", "client/sent", "worker/take", "client/reply"} <= set(counts)
