"""Tasks go to the worker that already holds their data (data-affinity scheduling).

    python examples/affinity.py

Starts a throwaway ZooKeeper and two workers of this module's ``app``; each
keeps a small cache of "datasets" (two of them) and says what it holds with
``celery_zk.features.affinity.holding``. Then it sends 40 ``summarize`` tasks over four
datasets, each with ``headers={"zk_affinity": dataset}``, and prints which
worker ran each dataset's tasks and how often a dataset had to be loaded.
Without affinity about half the tasks would load their dataset; with it,
each worker keeps to its own two. Exit status 0 when every task ran and
fewer than a quarter of them had to load.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter, OrderedDict

from celery import Celery, group
from example_worker import Example

from celery_zk import affinity

URL_ENV = "CELERY_ZK_AFFINITY_URL"
MODULE = "affinity"
CACHE_SIZE = 2

app = Celery("affinity", broker=os.environ.get(URL_ENV, "zk://"),
             backend=os.environ.get(URL_ENV, "zk://"))
app.conf.update(broker_connection_retry_on_startup=True, worker_hijack_root_logger=False)

_cache: OrderedDict[str, str] = OrderedDict()   # this worker process's datasets
_lock = threading.Lock()


@app.task(bind=True)
def summarize(self, dataset: str) -> list[str]:
    with _lock:
        if dataset in _cache:
            _cache.move_to_end(dataset)
            how = "cached"
        else:
            time.sleep(0.2)   # load it from far away
            _cache[dataset] = f"rows of {dataset}"
            while len(_cache) > CACHE_SIZE:
                _cache.popitem(last=False)
            affinity.holding(_cache)   # tell the consumers what this worker holds now
            how = "loaded"
    time.sleep(0.02)   # work on it
    return [self.request.hostname.partition("@")[0], dataset, how]


def main() -> int:
    with Example(MODULE, URL_ENV, "affinity-example") as example:
        example.start_worker(name="left", concurrency=1)
        example.start_worker(name="right", concurrency=1)
        datasets = [f"dataset-{i % 4}" for i in range(40)]
        tasks = group(example.client.signature("affinity.summarize", (name,),
                                               headers={"zk_affinity": name})
                      for name in datasets)
        results = tasks.apply_async().get(timeout=120)
        ran_on: dict[str, Counter[str]] = {}
        loads = 0
        for worker, dataset, how in results:
            ran_on.setdefault(dataset, Counter())[worker] += 1
            loads += how == "loaded"
        for dataset, workers in sorted(ran_on.items()):
            print(f"{dataset}: {dict(workers)}")
        print(f"{len(results)} tasks, {loads} loaded their dataset "
              f"({len(results) - loads} found it cached)")
        return 0 if len(results) == len(datasets) and loads < len(datasets) / 4 else 1


if __name__ == "__main__":
    sys.exit(main())
