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
import signal
import sys
import tempfile
import time
from pathlib import Path

import kombu.pools
from celery import Celery
from example_worker import start_worker, stop_worker

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
    from celery_zk.server import ZooKeeperServer

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with ZooKeeperServer() as zk, tempfile.TemporaryDirectory() as tmp:
        url = f"zk://{zk.hosts}/singleton-example"
        worker = start_worker(MODULE, {URL_ENV: url}, Path(tmp) / "worker.log")
        client = Celery("client", broker=url, backend=url, set_as_current=False)
        try:
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
        finally:
            client.backend.close()
            client.close()
            kombu.pools.reset()  # app.close() leaves pooled producers connected
            stop_worker(worker)


if __name__ == "__main__":
    sys.exit(main())
