"""Failed ZooKeeper transactions, counted on the server side from its transaction log.

A multi that fails (a claim another consumer won) or a create that finds its
node is still a transaction: it gets a zxid and is logged and fsynced like a
successful one. ZooKeeper 3.8's ``mntr`` counts none of them (its only
failure counters are for authentication and unrecoverable errors), so
``workers.py`` reads the log itself: that works whatever a transport does
inside, and needs nothing of celery_zk's.

The format (``FileTxnLog``): a 16-byte header (magic ``ZKLG``, version,
database id), then records of a CRC (8 bytes), a length (4), the entry and an
end-of-record byte. An entry starts with the TxnHeader (client id, cxid,
zxid, time, type); a failed request has type -1 (``OpCode.error``), a failed
multi type 14 with at least one sub-transaction of type -1. Logs are
preallocated: a zero length ends one.
"""
from __future__ import annotations

import glob
import os
import struct
from dataclasses import dataclass, field

from celery_zk.server import four_letter_word

MAGIC = 0x5A4B4C47       # "ZKLG"
MULTI, ERROR = 14, -1
FILE_HEADER = struct.Struct(">iiq")
RECORD = struct.Struct(">qi")          # crc, entry length
TXN_HEADER = struct.Struct(">qiqqi")   # client id, cxid, zxid, time, type
INT = struct.Struct(">i")


@dataclass
class TxnCounts:
    transactions: int = 0     # every logged transaction, session ones included
    failed_multis: int = 0
    failed_requests: int = 0  # single requests that failed (a create that found its node)
    errors: dict[str, int] = field(default_factory=dict)   # by kind and error code
    kinds: dict[str, int] = field(default_factory=dict)    # every transaction, by type

    def add_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    @property
    def failed(self) -> int:
        return self.failed_multis + self.failed_requests


def last_zxid(host: str, port: int) -> int:
    """The server's last zxid (``srvr``)."""
    reply = four_letter_word(host, port, "srvr", timeout=10)
    for line in reply.splitlines():
        if line.startswith("Zxid:"):
            return int(line.split(":", 1)[1].strip(), 16)
    raise RuntimeError(f"no Zxid in srvr's reply: {reply!r}")


def packets(host: str, port: int) -> tuple[int, int]:
    """The client packets a server received (requests, pings) and sent (their
    replies, and watch events) since it started (``srvr``)."""
    reply = four_letter_word(host, port, "srvr", timeout=10)
    counts = dict(line.split(":", 1) for line in reply.splitlines()
                  if line.startswith(("Received:", "Sent:")))
    return int(counts["Received"]), int(counts["Sent"])


#: KeeperException codes a queue's transactions meet.
CODES = {-101: "NoNode", -103: "BadVersion", -110: "NodeExists", -111: "NotEmpty",
         -2: "RuntimeInconsistency"}
#: ZooKeeper's OpCodes of the transactions a log holds.
KINDS = {1: "create", 2: "delete", 5: "setData", 14: "multi", 15: "create2",
         -10: "createSession", -11: "closeSession", -1: "error"}


def _multi_error(entry: bytes, offset: int) -> int | None:
    """The error code of the op that failed the multi (the others carry OK or
    RuntimeInconsistency; ZooKeeper applies none of them), None if it committed."""
    (count,) = INT.unpack_from(entry, offset)
    offset += INT.size
    found = None
    for _ in range(count):
        sub_type, length = struct.unpack_from(">ii", entry, offset)
        if sub_type == ERROR:
            (code,) = INT.unpack_from(entry, offset + 8)
            if code not in (0, -2) or found is None:
                found = code
        offset += 8 + length
    return found


def count(data_dir: str, after: int, upto: int) -> TxnCounts:
    """Transactions with ``after`` < zxid <= ``upto`` in ``data_dir``'s logs."""
    counts = TxnCounts()
    for path in sorted(glob.glob(os.path.join(data_dir, "version-2", "log.*"))):
        if int(path.rpartition(".")[2], 16) > upto:   # named by the first zxid in it
            continue
        with open(path, "rb") as fh:
            magic, _, _ = FILE_HEADER.unpack(fh.read(FILE_HEADER.size))
            if magic != MAGIC:
                raise RuntimeError(f"{path} is not a ZooKeeper transaction log")
            while True:
                head = fh.read(RECORD.size)
                if len(head) < RECORD.size:
                    break
                _, length = RECORD.unpack(head)
                if length <= 0:
                    break
                entry = fh.read(length + 1)   # + end-of-record byte
                _, _, zxid, _, kind = TXN_HEADER.unpack_from(entry)
                if not after < zxid <= upto:
                    continue
                counts.transactions += 1
                name = KINDS.get(kind, str(kind))
                counts.kinds[name] = counts.kinds.get(name, 0) + 1
                if kind == ERROR:
                    counts.failed_requests += 1
                    code = INT.unpack_from(entry, TXN_HEADER.size)[0]
                    counts.add_error(f"request {CODES.get(code, code)}")
                elif kind == MULTI and (code := _multi_error(entry, TXN_HEADER.size)) is not None:
                    counts.failed_multis += 1
                    counts.add_error(f"multi {CODES.get(code, code)}")
    return counts
