"""One run at a time per key, on a lock that dies with its holder (no TTL).

    python examples/singleton.py

Starts a throwaway ZooKeeper and a worker of this module's ``app``, calls
``nightly_report`` twice for the same customer while the first run is still
going, and once for another customer. The second call fails at once with
``LockHeld``, naming the run that holds the lock; the other customer's runs
alongside. Exit status 0 when that is what happened.
"""
from __future__ import annotations

import os
import sys
import time

from celery import Celery
from example_worker import Example

from celery_zk import Singleton

URL_ENV = "CELERY_ZK_SINGLETON_URL"
MODULE = "singleton"

app = Celery("singleton", broker=os.environ.get(URL_ENV, "zk://"),
             backend=os.environ.get(URL_ENV, "zk://"))
app.conf.update(broker_connection_retry_on_startup=True, worker_hijack_root_logger=False)


@app.task(bind=True, base=Singleton, lock_key="report-{0}")
def nightly_report(self: Singleton, customer: str) -> str:
    # self.lock.token grows with every lock taken: hand it to the store you
    # write to, so a run that lost its lock (its worker presumed dead) is refused.
    time.sleep(2)
    return f"report for {customer} (fencing token {self.lock.token})"


def main() -> int:
    with Example(MODULE, URL_ENV, "singleton-example") as example:
        example.start_worker()
        client = example.client
        first = client.send_task("singleton.nightly_report", ("acme",))
        time.sleep(0.5)   # the first run has taken its lock
        second = client.send_task("singleton.nightly_report", ("acme",))
        other = client.send_task("singleton.nightly_report", ("globex",))
        try:
            second.get(timeout=30)
            print("second call ran: unexpected")
            return 1
        except Exception as exc:   # LockHeld, raised in the worker
            print(f"second call: {type(exc).__name__}: {exc}")
        print(f"first call: {first.get(timeout=30)}")
        print(f"other customer: {other.get(timeout=30)}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
