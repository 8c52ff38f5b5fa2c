"""One publisher process of the storage budget's fill test (test_budget.py).

``python fill_publisher.py BROKER COUNT PREFIX OUT PAYLOAD_BYTES``: sends
``record(PREFIX-i, payload)`` COUNT times and appends each value to OUT once
its ``delay()`` has returned; on ``StorageFull`` appends ``refused`` and stops.
"""
from __future__ import annotations

import sys

from workers import client_env


def main(broker: str, count: int, prefix: str, out: str, payload_bytes: int) -> None:
    client_env(broker)
    from proj.app import record

    from celery_zk.exceptions import StorageFull

    payload = "x" * payload_bytes
    with open(out, "a", buffering=1) as returned:
        for index in range(count):
            value = f"{prefix}-{index}"
            try:
                record.delay(value, payload)
            except StorageFull as exc:
                returned.write(f"refused {exc}\n")
                return
            returned.write(value + "\n")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
