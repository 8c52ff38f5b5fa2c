"""The Celery app real test workers run: configured entirely from the environment.

CELERY_ZK_TEST_BROKER / CELERY_ZK_TEST_BACKEND give the URLs; CELERY_ZK_TEST_LOG
is a file each executed task appends one line to (so tests can count
executions, duplicates included, across worker processes).
"""
from __future__ import annotations

import json
import os
import time

from celery import Celery

app = Celery(
    "proj",
    broker=os.environ.get("CELERY_ZK_TEST_BROKER", "zk://127.0.0.1:2181/celery-test"),
    backend=os.environ.get("CELERY_ZK_TEST_BACKEND") or None,
)
app.conf.update(
    worker_hijack_root_logger=False,
    worker_send_task_events=bool(os.environ.get("CELERY_ZK_TEST_EVENTS")),
    task_send_sent_event=bool(os.environ.get("CELERY_ZK_TEST_EVENTS")),
    broker_connection_retry_on_startup=True,
    result_extended=bool(os.environ.get("CELERY_ZK_TEST_RESULT_EXTENDED")),
    task_track_started=bool(os.environ.get("CELERY_ZK_TEST_TRACK_STARTED")),
)
if os.environ.get("CELERY_ZK_TEST_CONF"):
    app.conf.update(json.loads(os.environ["CELERY_ZK_TEST_CONF"]))


def send_creates_late(seconds: float) -> None:
    """Every kazoo ``create_async`` goes out ``seconds`` late (a slow network), so a
    process that exits right after publishing still has its creates in flight."""
    import threading

    from kazoo.client import KazooClient

    real = KazooClient.create_async

    def late(self: KazooClient, *args: object, **kwargs: object) -> object:
        proxy = self.handler.async_result()

        def send() -> None:
            def relay(result: object) -> None:
                if result.exception is None:  # type: ignore[attr-defined]
                    proxy.set(result.value)  # type: ignore[attr-defined]
                else:
                    proxy.set_exception(result.exception)  # type: ignore[attr-defined]
            real(self, *args, **kwargs).rawlink(relay)  # type: ignore[arg-type]

        timer = threading.Timer(seconds, send)
        timer.daemon = True
        timer.start()
        return proxy

    KazooClient.create_async = late  # type: ignore[method-assign]


if os.environ.get("CELERY_ZK_TEST_LATE_CREATES"):
    send_creates_late(float(os.environ["CELERY_ZK_TEST_LATE_CREATES"]))


def _record(kind: str, value: object) -> None:
    path = os.environ.get("CELERY_ZK_TEST_LOG")
    if path:
        line = json.dumps({"kind": kind, "value": value, "pid": os.getpid()}) + "\n"
        # One write() on an O_APPEND descriptor: lines from several processes
        # never interleave (a reader may still see the last one half written).
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task
def record(value: object, payload: str = "") -> object:
    """``payload``: ignored; it makes the message as big as a test needs."""
    _record("record", value)
    return value


@app.task(acks_late=True)
def slow_record(value: object, seconds: float = 0.5) -> object:
    time.sleep(seconds)
    _record("slow_record", value)
    return value


@app.task
def fail(message: str = "boom") -> None:
    raise ValueError(message)


@app.task
def tsum(values: list[int]) -> int:
    return sum(values)


@app.task
def fanout_subtasks(n: int) -> list[str]:
    """Publishes n subtasks from inside a task (in a prefork child: after fork)."""
    return [record.delay(f"sub-{i}").id for i in range(n)]


# -- result backend tests (append-only) -----------------------------------------
@app.task(bind=True, max_retries=3, default_retry_delay=0.1)
def retry_once(self, value: object) -> object:
    """Fails its first run with a retry, then returns ``value``."""
    if self.request.retries == 0:
        raise self.retry(exc=RuntimeError("first run retries"), countdown=0.1)
    return value


@app.task
def huge_result(size: int) -> str:
    return "x" * size


@app.task
def record_then_sleep(value: object, seconds: float = 0.5) -> object:
    _record("record_then_sleep", value)
    time.sleep(seconds)
    return value


@app.task
def sleep_then(value: object, seconds: float = 0.5) -> object:
    time.sleep(seconds)
    return value


@app.task
def whoami(value: object) -> list[object]:
    return [value, os.getpid()]


# -- security tests (append-only) -----------------------------------------------
@app.task
def call(fn: object, *args: object) -> object:
    """Runs a function sent as an argument (needs the cloudpickle serializer)."""
    value = fn(*args)  # type: ignore[operator]
    _record("call", value)
    return value


# -- session and Celery-suite tests (append-only) ---------------------------------
@app.task
def wait_for(task_id: str, timeout: float) -> str:
    """Joins another task's result from inside a task, as a chord join does."""
    from celery.exceptions import TimeoutError as CeleryTimeout

    try:
        return str(app.AsyncResult(task_id).get(timeout=timeout, disable_sync_subtasks=False))
    except CeleryTimeout:
        return "timed out"


if os.environ.get("CELERY_ZK_TEST_DIE_AFTER_SUCCESS"):
    import signal

    from celery.signals import task_success

    @task_success.connect(weak=False)
    def _die_before_the_ack(**_: object) -> None:
        """The result is stored (task_success follows it); a late ack is not sent
        yet: the worker dies as a power cut would take it."""
        os.kill(os.getpid(), signal.SIGKILL)


from celery_zk import Singleton  # noqa: E402


def _single(task: Singleton, key: str, seconds: float) -> list[object]:
    started = time.time()
    held_at_start = task.lock_held()
    time.sleep(seconds)
    entry = [key, started, time.time(), task.lock.token, held_at_start, task.lock_held()]
    _record("single", entry)
    return entry


@app.task(bind=True, base=Singleton, lock_key="single-{0}")
def single_skip(self: Singleton, key: str, seconds: float = 0.0) -> list[object]:
    """A second call while one runs fails with LockHeld."""
    return _single(self, key, seconds)


@app.task(bind=True, base=Singleton, lock_key="single-{0}", lock_wait=120)
def single_wait(self: Singleton, key: str, seconds: float = 0.0) -> list[object]:
    """A second call while one runs waits for the lock."""
    return _single(self, key, seconds)


# -- affinity tests (append-only) -------------------------------------------------
@app.task(bind=True)
def hold_keys(self, keys: list[str]) -> list[object]:
    """This worker (its pool process, in prefork) now holds ``keys``."""
    from celery_zk import affinity

    affinity.hold(*keys, app=app)
    return [self.request.hostname, os.getpid()]


@app.task(bind=True)
def where_run(self, value: object) -> str:
    _record("where", [value, self.request.hostname])
    return str(self.request.hostname)


# -- chord tests (append-only) ----------------------------------------------------
@app.task(bind=True)
def grow_chord(self, value: int, extra: int) -> int:
    """A header task that adds ``add(extra, 100)`` to its own chord."""
    self.add_to_chord(add.s(extra, 100))
    return value


# -- big payload tests (append-only) -----------------------------------------------
@app.task
def big_text(size: int, seed: int = 0) -> str:
    """``size`` characters that differ along the string and from seed to seed, so
    chunks joined out of order, repeated or mixed with another result show."""
    import random

    return random.Random(seed).randbytes(size // 2 + 1).hex()[:size]


@app.task
def pattern_text(size: int, seed: int = 0) -> str:
    """``size`` characters, distinct per seed, that compress well (a chord body
    message carrying several of them stays below max_message_size gzipped)."""
    line = f"part {seed}: " + "abcdefgh" * 120 + "\n"
    return (line * (size // len(line) + 1))[:size]


@app.task
def digests(values: list[str]) -> list[list[object]]:
    """Length and sha256 of each value: a chord body that saw every byte."""
    import hashlib

    return [[len(v), hashlib.sha256(v.encode()).hexdigest()] for v in values]


if os.environ.get("CELERY_ZK_TEST_DIE_AT_CHUNK"):
    import signal

    from kazoo.client import KazooClient

    from celery_zk.zk.names import chunk_name

    _fatal_chunk = "/" + chunk_name(int(os.environ["CELERY_ZK_TEST_DIE_AT_CHUNK"]))
    _create_async = KazooClient.create_async

    def _create_or_die(self: KazooClient, path: str, *args: object,
                       **kwargs: object) -> object:
        """The worker dies (SIGKILL) between two chunks of a result: the chunks
        before this one are stored, this one and the done node never are."""
        if path.endswith(_fatal_chunk):
            time.sleep(0.5)   # the chunks already sent land
            os.kill(os.getpid(), signal.SIGKILL)
        return _create_async(self, path, *args, **kwargs)  # type: ignore[arg-type]

    KazooClient.create_async = _create_or_die  # type: ignore[method-assign]


@app.task
def slow_digest(value: str, seconds: float) -> list[object]:
    """Length and sha256 of ``value``, after ``seconds`` (unless SLOW_DIGEST_FAST)."""
    import hashlib

    if not os.environ.get("SLOW_DIGEST_FAST"):
        time.sleep(seconds)
    return [len(value), hashlib.sha256(value.encode()).hexdigest()]


@app.task(acks_late=True)
def timed(value: object, seconds: float = 0.0, customer: str = "") -> object:
    """Records when it started and ended (limits' tests measure windows and overlaps)."""
    started = time.time()
    # Its start too: a run killed midway leaves no "timed" line.
    _record("timed-start", {"value": value, "start": started, "customer": customer})
    if seconds:
        time.sleep(seconds)
    _record("timed", {"value": value, "start": started, "end": time.time(),
                      "customer": customer})
    return value


# -- worker behaviours (append-only) ------------------------------------------------
if os.environ.get("CELERY_ZK_TEST_BROADCAST"):   # a Broadcast queue beside the default
    from kombu import Queue
    from kombu.common import Broadcast

    app.conf.task_queues = [Queue("celery"), Broadcast(os.environ["CELERY_ZK_TEST_BROADCAST"])]


@app.task(acks_late=True, reject_on_worker_lost=True)
def die_once(value: object, marker: str) -> object:
    """Kills its own pool process the first time (``marker`` does not exist yet)."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), 9)
    _record("die_once", value)
    return value


@app.task
def timed_early(value: object, seconds: float = 0.0, customer: str = "") -> object:
    """``timed`` acked as it starts (Celery's default), logged as ``timed``."""
    return timed.run(value, seconds, customer)
