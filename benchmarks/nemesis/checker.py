"""The nemesis's checker: what the recorded history must show, and what it does.

Pure functions over the journals (:mod:`nemesis.history`), the results read
back at the end, and the faults as they happened; what ZooKeeper holds at the
end is read by :mod:`nemesis.state`. The properties:

* every task whose ``apply_async`` returned (chord parts and bodies included)
  completed at least once, and its result is readable: ``SUCCESS``, or
  ``REVOKED`` for a task revoked before it was due;
* every chord body ran after all its parts had completed, and was sent once:
  any further execution is a redelivery after a lost owner;
* a second execution only follows a lost owner (the same message, redelivered,
  its owner hit by a fault or killed mid-task) or a publish retry (a second
  message, after kombu retried the publish, or after celery_zk published again
  because a publish's reply was lost and its message was no longer to be found);
* no task started after its revoke returned (the revoke is stored in
  ZooKeeper before its broadcast goes out).
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from celery_zk.zk.message_names import parse_message_name

#: Faults that take an owner away from its session, by the owner's host.
OWNER_FAULTS = {"kill-worker": "owner killed", "pause-worker": "owner paused",
                "partition-worker": "owner partitioned",
                "partition-split": "owner on the minority side"}
EXAMPLES = 20
DEAF = "its worker no longer receives broadcasts"
#: A task that starts within this long after its worker logged the revoke raced it:
#: Celery checks the revoked set before it hands the task to the pool.
REVOKE_RACE = 1.0


def message_identity(tag: str) -> str:
    """The published message a delivery came from: its publish's uid and first
    sequence survive a requeue (``n{P}-{gen}-{uid}-r{first}``)."""
    parsed = parse_message_name(tag)
    return f"{parsed.uid}-{parsed.order}" if parsed else tag


@dataclass
class History:
    """The journals, indexed."""

    publishes: list[dict[str, Any]]
    executions: list[dict[str, Any]]
    #: task id -> what its publish said (kind, and for a body its chord)
    expected: dict[str, dict[str, Any]] = field(default_factory=dict)
    revoked: dict[str, float] = field(default_factory=dict)
    retried: set[str] = field(default_factory=set)
    starts: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    ends: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    failed_publishes: int = 0

    @classmethod
    def build(cls, publisher: list[dict[str, Any]], executions: list[dict[str, Any]]
              ) -> History:
        history = cls([e for e in publisher if e["e"] == "publish"], executions)
        by_seq: dict[int, list[str]] = {}
        for entry in history.publishes:
            if entry["kind"] == "chord":
                for part in entry["parts"]:
                    history.expected[part] = {"kind": "part", "chord": entry["id"],
                                              "t": entry["t"]}
                history.expected[entry["id"]] = {"kind": "body", "parts": entry["parts"],
                                                 "t": entry["t"]}
                by_seq[entry["seq"]] = [*entry["parts"], entry["id"]]
            else:
                history.expected[entry["id"]] = {"kind": entry["kind"], "t": entry["t"],
                                                 "due": entry.get("due", entry["t"])}
                by_seq[entry["seq"]] = [entry["id"]]
        body_of = {part: body for body, meta in history.expected.items()
                   if meta["kind"] == "body" for part in meta["parts"]}
        for entry in publisher:
            if entry["e"] == "revoke":
                history.revoked[entry["id"]] = entry["t"]
            elif entry["e"] == "fail":
                history.failed_publishes += 1
            elif entry["e"] == "retry":
                for name in entry["ids"]:
                    if name.startswith("seq-"):
                        history.retried.update(by_seq.get(int(name[4:]), []))
        for entry in executions:
            if entry["e"] == "retry":   # a worker retried a publish: a chord's body
                for task_id in entry["ids"]:
                    if task_id in body_of:
                        history.retried.add(body_of[task_id])
            elif entry["e"] == "start":
                history.starts[entry["id"]].append(entry)
            elif entry["e"] == "end":
                history.ends[entry["id"]].append(entry)
        return history

    def first_end(self, task_id: str) -> float | None:
        ends = self.ends.get(task_id)
        return min(e["t"] for e in ends) if ends else None

    def due_and_done(self) -> list[tuple[float, float | None]]:
        """(when each task not revoked was due, when it first completed: None if
        never), by due time: what the catch-up after a heal is measured on."""
        pairs = [(meta.get("due", meta["t"]), self.first_end(task_id))
                 for task_id, meta in self.expected.items() if task_id not in self.revoked]
        # A task never completed (lost) sorts after its peers: None is not comparable.
        return sorted(pairs, key=lambda pair: (pair[0], math.inf if pair[1] is None
                                               else pair[1]))


def _owner_cause(host: str, since: float, until: float, ended: bool,
                 faults: list[dict[str, Any]]) -> str | None:
    """Why the owner on ``host`` lost a message it held from about ``since`` (its
    first execution) to ``until`` (the other execution): a fault on its host then,
    else a ZooKeeper fault then (its connection or session went: a server
    partitioned, killed or paused, or split off with the minority while the
    owner was connected to it), else the execution never ending (killed mid-task)."""
    slack = 60.0   # a message is claimed (prefetched) before it starts
    overlapping = [f for f in faults if f["started"] <= until
                   and (f["healed"] or until) >= since - slack]
    overlapping.sort(key=lambda f: f["started"], reverse=True)   # the latest is the cause
    for fault in overlapping:
        on_host = fault["target"] == host or host in fault.get("minority", [])
        if fault["kind"] in OWNER_FAULTS and on_host:
            return OWNER_FAULTS[fault["kind"]]
    for fault in overlapping:
        if fault["kind"] not in OWNER_FAULTS:
            return f"owner's connection lost in {fault['kind']}"
        if fault["kind"] == "partition-split":
            # The owner on the majority side, connected to the server cut off
            # with the minority: its connection went (as in partition-zk).
            return "owner's server on the minority side"
    if not ended:
        return "owner lost mid-task"
    return None


def why_again(history: History, task_id: str, previous: dict[str, Any],
              later: dict[str, Any], faults: list[dict[str, Any]]) -> tuple[str, bool]:
    """(why ``later`` ran although ``previous`` had, allowed?)."""
    same = message_identity(previous["tag"]) == message_identity(later["tag"])
    if same and later["redelivered"]:
        ended = any(e["pid"] == previous["pid"] and e["t"] >= previous["t"]
                    for e in history.ends.get(task_id, []))
        cause = _owner_cause(previous["host"], previous["t"], later["t"], ended, faults)
        if cause is None:
            return "redelivered, but no fault took its owner", False
        return f"redelivered: {cause}", True
    if same and previous["redelivered"]:
        # The first delivery ran last: its owner held it (prefetched, or due
        # later) while its session expired, and ran it once it was back.
        cause = _owner_cause(later["host"], previous["t"], later["t"], True, faults)
        if cause is None:
            return "a first delivery ran after its redelivery, no fault on its owner", False
        return f"stale copy run by its lost owner: {cause}", True
    if same and task_id in history.retried:
        # A hand-off whose reply was lost, its message acked before the look that
        # found it gone: stored again under its name, and said so (B22).
        return "publish retry after a lost reply: the same message stored again", True
    if same:
        return "the same message delivered twice, neither time redelivered", False
    if task_id in history.retried:
        return "publish retry: a second message", True
    return "a second message without a publish retry", False


def check(history: History, results: dict[str, str | None], faults: list[dict[str, Any]],
          deaf: frozenset[str] | set[str] = frozenset(),
          heard: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """The report's properties (every figure, each violation with an example).
    ``deaf``: workers that answered no broadcast at the end; ``heard``: {worker:
    {task id: when its log says the revoke arrived}}."""
    violations: list[str] = []
    lost: list[dict[str, Any]] = []
    unreadable: list[dict[str, Any]] = []
    for task_id, meta in history.expected.items():
        state = results.get(task_id)
        if task_id in history.revoked:
            if state not in ("REVOKED", "SUCCESS"):
                unreadable.append({"id": task_id, "kind": "revoked", "state": state})
            continue
        if not history.ends.get(task_id):
            why = ("started, never completed" if history.starts.get(task_id)
                   else "never started")
            lost.append({"id": task_id, "kind": meta["kind"], "why": why,
                         "published": meta["t"]})
        elif state != "SUCCESS":
            unreadable.append({"id": task_id, "kind": meta["kind"], "state": state})
    if lost:
        violations.append(f"{len(lost)} task(s) lost")
    if unreadable:
        violations.append(f"{len(unreadable)} result(s) missing or wrong")

    why_counts: Counter[str] = Counter()
    duplicated: list[dict[str, Any]] = []
    for task_id, starts in history.starts.items():
        if len(starts) < 2:
            continue
        reasons = []
        for previous, later in zip(starts, starts[1:]):
            why, allowed = why_again(history, task_id, previous, later, faults)
            why_counts[why] += 1
            reasons.append(why)
            if not allowed:
                violations.append(f"task {task_id} ran again: {why}")
        duplicated.append({"id": task_id, "executions": len(starts), "why": reasons,
                           "hosts": [s["host"] for s in starts]})

    revoke_violations: list[dict[str, Any]] = []
    raced: list[dict[str, Any]] = []
    for task_id, at in history.revoked.items():
        late = [s for s in history.starts.get(task_id, []) if s["t"] > at]
        if not late:
            continue
        host, started = late[0]["host"], late[0]["t"]
        told = (heard or {}).get(host, {}).get(task_id)
        entry = {"id": task_id, "revoked": at, "started": started, "host": host}
        if host in deaf:
            entry["why"] = DEAF
        elif heard is not None and told is None:
            entry["why"] = "its worker never got the broadcast"
        elif told is not None and started < told + REVOKE_RACE:
            # A revoke reaches a running worker as a broadcast, as on any broker:
            # one that arrives as the task starts cannot stop it.
            raced.append({**entry, "lag": round(started - at, 3)})
            continue
        else:
            entry["why"] = "its worker had the broadcast"
        revoke_violations.append(entry)
    for why, count in Counter(v["why"] for v in revoke_violations).items():
        violations.append(f"{count} task(s) ran after their revoke: {why}")

    chords = [(body, meta) for body, meta in history.expected.items() if meta["kind"] == "body"]
    again = {d["id"]: d["why"] for d in duplicated}
    bodies_again = {body: again[body] for body, _ in chords if body in again}
    chord_violations = []
    for body_id, meta in chords:
        starts = history.starts.get(body_id, [])
        if not starts:
            continue   # counted as lost above
        first = starts[0]["t"]
        early = [p for p in meta["parts"] if (history.first_end(p) or float("inf")) > first]
        sent = {message_identity(s["tag"]) for s in starts}
        fresh = [s for s in starts if not s["redelivered"]]
        if early:
            chord_violations.append({"body": body_id, "why": f"ran before parts {early}"})
        if len(sent) > 1 and body_id not in history.retried:
            chord_violations.append({"body": body_id, "why": f"sent {len(sent)} times"})
        if len(fresh) > 1 and len(sent) == 1:
            chord_violations.append({"body": body_id, "why": "delivered fresh twice"})
    if chord_violations:
        violations.append(f"{len(chord_violations)} chord(s) broke their order or ran twice")

    executions = sum(len(s) for s in history.starts.values())
    return {
        "published": len(history.expected),
        "published_by_kind": dict(Counter(m["kind"] for m in history.expected.values())),
        "publish_failures": history.failed_publishes,
        "publish_retries": len(history.retried),
        "executed": executions,
        "completed": sum(1 for t in history.expected if history.ends.get(t)),
        "lost": {"count": len(lost), "examples": lost[:EXAMPLES]},
        "results_unreadable": {"count": len(unreadable), "examples": unreadable[:EXAMPLES]},
        "duplicated": {"count": len(duplicated),
                       "extra_executions": sum(d["executions"] - 1 for d in duplicated),
                       "why": dict(why_counts), "examples": duplicated[:EXAMPLES]},
        "chords": {"count": len(chords), "bodies_run_again": len(bodies_again),
                   "bodies_run_again_why": dict(Counter(w for ws in bodies_again.values()
                                                        for w in ws)),
                   "violations": chord_violations[:EXAMPLES]},
        "revokes": {"count": len(history.revoked),
                    "raced_the_broadcast": len(raced),
                    "raced_lag_max_s": max((r["lag"] for r in raced), default=None),
                    "violations": revoke_violations[:EXAMPLES]},
        "violations": violations[:200],
    }
