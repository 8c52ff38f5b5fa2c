"""The steady load behind the loaded shapes: no-op tasks at a fixed rate from another process.

:func:`load` runs it while a block runs (``python -m common.load URL QUEUE
RATE`` until stopped); :func:`warm_up_with_load` runs a worker under it
before zk is measured. ZooKeeper's JVM compiles its request path with C2
for about half a minute of such a load (its compiler thread took 0.4 of a
core for 25 s, then nothing): measured before, zk would pay for its
server's start, which a server running for days has paid long ago.
"""
from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from .figures import log
from .processes import BENCHMARKS, Processes, child_env, tail
from .worker import Workers


def publish_steadily(url: str, queue: str, rate: float) -> None:
    """The load process: ``rate`` no-op tasks per second into ``queue`` until killed."""
    from .app import NOOP, make_app

    noop = make_app(url).tasks[NOOP]
    start = time.monotonic()
    index = 0
    while True:
        delay = start + index / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        noop.apply_async((index,), queue=queue)
        index += 1


@contextmanager
def load(procs: Processes, work_dir: str, url: str, queue: str, rate: float
         ) -> Iterator[None]:
    """The load process publishing ``rate`` tasks/s (none if 0) while in the block."""
    if rate <= 0:
        yield
        return
    out = os.path.join(work_dir, f"load-{queue}.out")
    proc = procs.spawn([sys.executable, "-m", "common.load", url, queue, str(rate)], out,
                       child_env(), cwd=BENCHMARKS)
    try:
        time.sleep(2.0)   # connected and steady
        if proc.poll() is not None:
            raise RuntimeError(f"load process exited:\n{tail(out)}")
        yield
    finally:
        procs.stop_and_remove(proc)


def warm_up_with_load(procs: Processes, work_dir: str, url: str, seconds: float) -> None:
    """A worker under a 200 tasks/s load for ``seconds``, on a queue of its own: the
    multis, watch events and reads of a delivery, which a few seconds of plain
    requests (``warm_up_zookeeper``) do not reach."""
    if seconds <= 0:
        return
    log(f"warming up ZooKeeper with a worker under load for {seconds:.0f}s")
    queue = f"warm-up-{uuid.uuid4().hex[:8]}"
    with Workers(procs, work_dir, "warm-up-").worker(url, queue), \
            load(procs, work_dir, url, queue, 200.0):
        time.sleep(seconds)


if __name__ == "__main__":
    publish_steadily(sys.argv[1], sys.argv[2], float(sys.argv[3]))
