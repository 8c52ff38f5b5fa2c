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
import sys
from typing import Any, Callable

from celery import Celery
from example_worker import Example

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
    with Example(MODULE, URL_ENV, "cloudpickle-example",
                 credentials="example:example-password@") as example:
        example.start_worker()
        factor = 7

        def scale(x: int) -> int:  # a closure: it captures `factor`
            return x * factor

        result = example.client.send_task("cloudpickle_example.call", (scale, 6),
                                          serializer="cloudpickle")
        value = result.get(timeout=30)
        print(f"result: {value}")
        return 0 if value == 42 else 1


if __name__ == "__main__":
    sys.exit(main())
