"""The nemesis's publisher: a steady load, each ``apply_async`` that returned journaled.

Run by the harness inside its own host (``python -m nemesis.publisher --rate
100 --seed S``, with ``NEMESIS_URL`` and ``NEMESIS_DIR`` set) until SIGTERM.
Each publish is one of (seeded):

* a task (``nemesis.work``, 0-40 ms of work), one in five with a priority 0-9;
* a chord of three such tasks and a ``nemesis.body``;
* a task with a countdown (waiting in ZooKeeper until it is due), half of them
  revoked a second after the publish, long before they are due: those must
  never start after the revoke returned.

A publish that blocks (no quorum) is not made up for beyond one second's
worth: the rate is the offered load, not a backlog built in a burst.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import time
from collections import deque

from celery import chord

from .app import app, body, journal, publishing, work

CHORD_SHARE = 0.03
COUNTDOWN_SHARE = 0.02
PRIORITY_SHARE = 0.2
COUNTDOWN = 8.0
REVOKE_AFTER = 1.0


class Publisher:
    def __init__(self, rate: float, seed: int) -> None:
        self.rate = rate
        self.rng = random.Random(seed)
        self.seq = 0
        self.stopping = False
        self.revokes: deque[tuple[float, str]] = deque()

    def _ms(self) -> int:
        return self.rng.randint(0, 40)

    def publish_one(self) -> None:
        rng = self.rng
        self.seq += 1
        roll = rng.random()
        if roll < CHORD_SHARE:
            parts = [work.s(self.seq * 10 + i, self._ms()) for i in range(3)]
            chord_id = f"chord-{self.seq}"
            self._send(lambda: chord(parts)(body.s(chord_id)), "chord", chord_id=chord_id)
        elif roll < CHORD_SHARE + COUNTDOWN_SHARE:
            revoke = rng.random() < 0.5
            kind = "revoke" if revoke else "countdown"
            result = self._send(lambda: work.apply_async((self.seq, self._ms()),
                                                         countdown=COUNTDOWN), kind,
                                due=time.time() + COUNTDOWN)
            if result is not None and revoke:
                self.revokes.append((time.monotonic() + REVOKE_AFTER, result))
        else:
            priority = rng.randint(0, 9) if rng.random() < PRIORITY_SHARE else None
            self._send(lambda: work.apply_async((self.seq, self._ms()), priority=priority),
                       "task", priority=priority)

    def _send(self, call: object, kind: str, **extra: object) -> str | None:
        """Publish; journal it if ``apply_async`` returned (else journal the failure)."""
        publishing.clear()
        publishing.append(f"seq-{self.seq}")
        try:
            result = call()  # type: ignore[operator]
        except Exception as exc:   # counted as not published: the checker expects nothing
            journal().write(e="fail", seq=self.seq, kind=kind, error=repr(exc)[:300])
            return None
        finally:
            publishing.clear()
        if kind == "chord":
            parts = [r.id for r in result.parent.results]
            journal().write(e="publish", kind=kind, id=result.id, seq=self.seq, parts=parts,
                            group=result.parent.id, **extra)
        else:
            journal().write(e="publish", kind=kind, id=result.id, seq=self.seq, **extra)
        return str(result.id)

    def revoke_due(self, everything: bool = False) -> None:
        while self.revokes and (everything or self.revokes[0][0] <= time.monotonic()):
            _, task_id = self.revokes.popleft()
            try:
                app.control.revoke(task_id)
            except Exception as exc:
                journal().write(e="revoke-fail", id=task_id, error=repr(exc)[:300])
            else:   # stored in ZooKeeper before the broadcast went out
                journal().write(e="revoke", id=task_id)

    def run(self) -> None:
        interval = 1.0 / self.rate
        due = time.monotonic()
        while not self.stopping:
            self.revoke_due()
            now = time.monotonic()
            if now < due:
                time.sleep(min(due - now, 0.05))
                continue
            due = max(due + interval, now - 1.0)
            self.publish_one()
        self.revoke_due(everything=True)   # still long before those tasks are due
        journal().write(e="stopped", seq=self.seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    publisher = Publisher(args.rate, args.seed)

    def stop(*_: object) -> None:
        publisher.stopping = True
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    ready = os.environ.get("NEMESIS_READY_FILE")
    if ready:
        open(ready, "w").close()
    try:
        publisher.run()
    finally:
        app.close()


if __name__ == "__main__":
    main()
