"""Send a closure to a worker with the opt-in ``cloudpickle`` serializer.

    python examples/cloudpickle_example.py

Starts a throwaway ZooKeeper, a worker of this module's ``app`` in a
subprocess, sends it a closure (``json`` cannot carry a function, plain
``pickle`` cannot carry a closure), prints the result and stops everything.

cloudpickle, like pickle, runs arbitrary code when a message is *loaded*:
whoever can write to your queues can run code on your workers. That is why
the worker accepts it only because ``accept_content`` lists it, and why the
URL carries credentials: every node celery_zk creates then gets a digest ACL,
so only this user can write messages (see docs/security.md).
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import kombu.pools
from celery import Celery
from example_worker import start_worker, stop_worker

URL_ENV = "CELERY_ZK_CLOUDPICKLE_URL"
MODULE = "cloudpickle_example"

app = Celery("cloudpickle_example", broker=os.environ.get(URL_ENV, "zk://"),
             backend=os.environ.get(URL_ENV, "zk://"))
app.conf.update(
    # Opt in on the worker: without 'cloudpickle' here it refuses such messages
    # (ContentDisallowed). Results still travel as json.
    accept_content=["json", "cloudpickle"],
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task
def call(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a function the client sent."""
    return fn(*args)


def main() -> int:
    from celery_zk.server import ZooKeeperServer

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with ZooKeeperServer() as zk, tempfile.TemporaryDirectory() as tmp:
        url = f"zk://example:example-password@{zk.hosts}/cloudpickle-example"
        worker = start_worker(MODULE, {URL_ENV: url}, Path(tmp) / "worker.log")
        client = Celery("client", broker=url, backend=url, set_as_current=False)
        try:
            factor = 7

            def scale(x: int) -> int:  # a closure: it captures `factor`
                return x * factor

            result = client.send_task("cloudpickle_example.call", (scale, 6),
                                      serializer="cloudpickle")
            value = result.get(timeout=30)
            print(f"result: {value}")
            return 0 if value == 42 else 1
        finally:
            client.backend.close()
            client.close()
            kombu.pools.reset()  # app.close() leaves pooled producers connected
            stop_worker(worker)


if __name__ == "__main__":
    sys.exit(main())
