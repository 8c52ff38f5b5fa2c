"""A revoke sent while no worker runs is honoured by the worker started later.

    python examples/durable_revokes.py

Starts a throwaway ZooKeeper, queues two tasks, revokes one of them with no
worker running (on Redis or RabbitMQ that broadcast would reach nobody),
then starts a worker: it runs the other task and not the revoked one, whose
state is REVOKED. Exit status 0 when that is what happened.
"""
from __future__ import annotations

import os
import sys
import time

from celery import Celery
from example_worker import Example

URL_ENV = "CELERY_ZK_REVOKES_URL"
MODULE = "durable_revokes"

app = Celery("durable_revokes", broker=os.environ.get(URL_ENV, "zk://"),
             backend=os.environ.get(URL_ENV, "zk://"))
app.conf.update(broker_connection_retry_on_startup=True, worker_hijack_root_logger=False)


@app.task
def report(name: str) -> str:
    print(f"running {name}", flush=True)
    return name


def main() -> int:
    with Example(MODULE, URL_ENV, "durable-revokes") as example:
        client = example.client
        unwanted = client.send_task("durable_revokes.report", ("unwanted",))
        wanted = client.send_task("durable_revokes.report", ("wanted",))
        client.control.revoke(unwanted.id)
        print(f"revoked {unwanted.id} with no worker running; starting one")
        example.start_worker(pool="prefork")
        print(f"wanted: {wanted.get(timeout=60)}")
        deadline = time.monotonic() + 30
        while unwanted.state != "REVOKED" and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"unwanted: {unwanted.state}")
        ran_unwanted = "running unwanted" in example.worker_output()
        return 0 if unwanted.state == "REVOKED" and not ran_unwanted else 1


if __name__ == "__main__":
    sys.exit(main())
