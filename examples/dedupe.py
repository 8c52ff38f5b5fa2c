"""A task that succeeded is not run again when its worker dies before the ack.

    python examples/dedupe.py

Starts a throwaway ZooKeeper and a worker whose app sets ``task_acks_late``
and ``worker_deduplicate_successful_tasks`` (the recommended settings for
tasks that must not run twice). The worker dies (SIGKILL, as a power cut
would take it) right after ``charge`` succeeded and its result was stored,
before its late ack. ZooKeeper ends the dead worker's session, the message
goes back to the queue marked as redelivered, and a second worker receives
it, finds the stored SUCCESS and acks it without charging again. Exit status
0 when the charge ran exactly once.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from celery import Celery
from celery.signals import task_success
from example_worker import Example

URL_ENV = "CELERY_ZK_DEDUPE_URL"
MODULE = "dedupe"

app = Celery("dedupe", broker=os.environ.get(URL_ENV, "zk://"),
             backend=os.environ.get(URL_ENV, "zk://"))
app.conf.update(broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
                task_acks_late=True,                        # a crash mid-task runs it again...
                worker_deduplicate_successful_tasks=True)   # ...but never after it succeeded


@app.task
def charge(order: str) -> str:
    print(f"charging {order}", flush=True)
    return f"charged {order}"


if os.environ.get("DEDUPE_EXAMPLE_POWER_CUT"):
    @task_success.connect(weak=False)
    def _power_cut(**_: object) -> None:
        # The result is stored (task_success follows it); the late ack is not sent.
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    # A dead worker's messages come back once its session ends: 4 s here.
    with Example(MODULE, URL_ENV, "dedupe-example?session_timeout=4") as example:
        doomed = example.start_worker(name="doomed", env={"DEDUPE_EXAMPLE_POWER_CUT": "1"})
        result = example.client.send_task("dedupe.charge", ("order-1",))
        print(f"result: {result.get(timeout=60)}")
        doomed.wait(60)
        print(f"the worker died before its ack (exit {doomed.returncode})")
        example.start_worker(name="survivor")
        deadline = time.monotonic() + 60
        while ("already completed" not in example.worker_output("survivor")
               and time.monotonic() < deadline):
            time.sleep(0.2)
        runs = sum(example.worker_output(name).count("charging order-1")
                   for name in ("doomed", "survivor"))
        skipped = "already completed" in example.worker_output("survivor")
        print(f"the message came back; the survivor skipped it: {skipped}; "
              f"charges made: {runs}")
        return 0 if runs == 1 and skipped else 1


if __name__ == "__main__":
    sys.exit(main())
