"""Durable revokes: a revoke is kept in ZooKeeper, so a worker started later honours it.

The transport sees every broadcast it publishes: a ``revoke`` or
``revoke_by_stamped_headers`` meant for every worker is written to
``revoked/`` before the broadcast goes out. A worker (a process once Celery
sent it ``worker_init``) reads them as it starts consuming, before any task
is delivered. They are sharded like results, since Celery keeps up to 50,000
(more names than one listing may carry), and read in one pipelined round
over the shards. See ``docs/features.md``, "Durable revokes".
"""
from __future__ import annotations

import base64
import json
import logging
import time
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError

from ..zk.client import CONNECTION_ERRORS, listings, log_failure, reply_or_retry
from ..zk.layout import REVOKED_STAMP, REVOKED_TASK, Layout

logger = logging.getLogger(__name__)

__all__ = ["RevokeStore", "control_command", "load_into_worker"]

#: The control commands that are kept, and the argument naming what they revoke.
KEPT = {"revoke": "task_id", "revoke_by_stamped_headers": "headers"}


def control_command(message: dict[str, Any]) -> dict[str, Any] | None:
    """The body of a kombu pidbox broadcast (as the transport publishes it), if
    it is a revoke meant for every worker; else None."""
    try:
        raw = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            raw = base64.b64decode(raw)
        if message.get("content-type") != "application/json":
            return None
        body = json.loads(raw)
    except (KeyError, TypeError, ValueError):
        return None
    if not isinstance(body, dict) or body.get("method") not in KEPT or body.get("destination"):
        return None
    return body


class RevokeStore:
    """``revoked/`` under one root."""

    def __init__(self, client: KazooClient, layout: Layout) -> None:
        self.client = client
        self.layout = layout

    def keep(self, command: dict[str, Any]) -> int:
        """Write the revokes of a broadcast ``revoke`` / ``revoke_by_stamped_headers``
        (pipelined, idempotent: a revoke already kept keeps its first time)."""
        now = time.time()
        arguments = command.get("arguments") or {}
        nodes: list[tuple[str, dict[str, Any]]] = []
        if command["method"] == "revoke":
            ids = arguments.get("task_id") or []
            for task_id in [ids] if isinstance(ids, str) else ids:
                nodes.append((self.layout.revoked_task(str(task_id)),
                              {"at": now, "task_id": str(task_id)}))
        else:
            for header, stamps in (arguments.get("headers") or {}).items():
                for stamp in stamps if isinstance(stamps, list) else [stamps]:
                    nodes.append((self.layout.revoked_stamp(str(header), json.dumps(stamp)),
                                  {"at": now, "header": header, "stamp": stamp}))
        client = self.client
        pending = [client.create_async(path, json.dumps(data).encode(), makepath=True)
                   for path, data in nodes]
        kept = 0
        for reply in pending:
            try:
                reply.get()
                kept += 1
            except NodeExistsError:
                pass
        return kept

    def kept(self, task_id: str, expires: float) -> bool:
        """Whether a revoke of ``task_id`` younger than ``expires`` seconds is
        kept (one read; connection errors are raised)."""
        client = self.client
        try:
            data, _ = client.retry(client.get, self.layout.revoked_task(task_id))
            at = float(json.loads(data)["at"])
        except NoNodeError:
            return False
        except (ValueError, KeyError, TypeError):
            return False   # unreadable: ignored, as load() ignores it
        return at + expires > time.time()

    def load(self, expires: float
             ) -> tuple[list[tuple[str, float]], dict[str, list[tuple[Any, float]]]]:
        """``([(task id, at)], {header: [(stamp, at)]})`` of revokes younger than
        ``expires`` seconds; older ones are deleted."""
        now = time.time()
        client = self.client
        shards = self.layout.shards(self.layout.revoked)
        paths = []
        for shard, names in listings(client, shards):
            paths += [f"{shard}/{name}" for name in names
                      if name.startswith((REVOKED_TASK, REVOKED_STAMP))]
        reads = [(path, client.get_async(path)) for path in paths]
        tasks: list[tuple[str, float]] = []
        stamps: dict[str, list[tuple[Any, float]]] = {}
        for path, reply in reads:
            try:
                data, _ = reply_or_retry(client, reply, client.get, path)
                entry = json.loads(data)
                at = float(entry["at"])
            except NoNodeError:
                continue
            except (ValueError, KeyError, TypeError):
                logger.warning("celery_zk: ignoring unreadable revoke %s", path)
                continue
            if at + expires <= now:
                client.delete_async(path)   # expired: Celery would have forgotten it too
            elif "task_id" in entry:
                tasks.append((str(entry["task_id"]), at))
            elif "header" in entry:
                stamps.setdefault(str(entry["header"]), []).append((entry.get("stamp"), at))
        return tasks, stamps


def load_into_worker(client: KazooClient, layout: Layout) -> None:
    """Add the kept revokes to this process's Celery worker state."""
    from celery.worker import state as worker_state

    try:
        tasks, stamps = RevokeStore(client, layout).load(worker_state.REVOKE_EXPIRES)
    except CONNECTION_ERRORS as exc:
        # The worker goes on; the revokes kept are missed, as they would be on
        # another broker. Said loudly.
        log_failure(logger, exc, "celery_zk: could not read the revokes kept in ZooKeeper; "
                    "revoked tasks published before this worker started may run")
        return
    for task_id, at in tasks:
        worker_state.revoked.add(task_id, now=at)
    for header, values in stamps.items():
        known = worker_state.revoked_stamps.get(header) or []
        known = list(known) if isinstance(known, (list, tuple)) else [known]
        worker_state.revoked_stamps[header] = known + [v for v, _ in values if v not in known]
    if tasks or stamps:
        logger.info("celery_zk: %d revoked task(s) and %d revoked stamp(s) kept in "
                    "ZooKeeper apply to this worker", len(tasks),
                    sum(len(v) for v in stamps.values()))
