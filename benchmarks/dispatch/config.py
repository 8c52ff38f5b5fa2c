"""What a run of the dispatch model is: its tuning, its names, what it counts.

Every path and node name of the model is built here (``Paths``), as
``celery_zk/zk/layout.py`` builds the transport's.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from kazoo.client import KazooClient

from . import wire

VARIANTS = ("selfclaim", "dispatch-copy", "dispatch-names")
BUCKET_SIZE = 4096        # celery_zk's default bucket_size
ACK_MAX = 16              # acks in one multi at most
ACK_DELAY = 0.005         # ... or the oldest waited this long
LISTING_MAX_AGE = 1.0     # selfclaim: celery_zk's listing_max_age
MOVE_MAX = 64             # dispatcher: messages in one multi at most
MOVE_BYTES = 512_000      # ... and bytes of bodies in one multi
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Tuning:
    """How the client side does its work (what ``--parts ladder`` varies)."""

    reads: str = "async"          # seq: one get at a time, async: pipelined gets, multi: multiRead
    inbox_watch: str = "child"    # a consumer's inbox: child watch + listing, or tree (events)
    credit_watch: str = "child"   # dispatcher: child watch per inbox + listing, or tree on owned/
    unowned_watch: str = "child"  # dispatcher: child watches + listing, or tree on unowned/
    handler: str = "kazoo"        # kazoo's handler, or select: plain select() in its loop
    raw: bool = False             # requests built directly, not through kazoo's transaction()
    inline: bool = False          # replies handled on kazoo's connection thread (needs raw)
    batches: bool = False         # the dispatcher marks each inbox's last entry of a move:
                                  # consumers read, hand over and ack per batch, not per event
    buffered: bool = False        # kazoo's loop reads all the socket holds at once (needs select)
    one_in_flight: bool = False   # a dispatcher's move, a consumer's ack: one multi on its way
                                  # at a time, the next one takes all that came meanwhile

    def label(self) -> str:
        return (f"reads={self.reads} inbox={self.inbox_watch} credit={self.credit_watch} "
                f"unowned={self.unowned_watch} handler={self.handler} raw={int(self.raw)} "
                f"inline={int(self.inline)} batches={int(self.batches)} "
                f"buffered={int(self.buffered)} one_in_flight={int(self.one_in_flight)}")


BASELINE = Tuning()
TUNED = Tuning(reads="multi", inbox_watch="tree", credit_watch="tree", handler="select",
               raw=True, inline=True, batches=True, buffered=True, one_in_flight=True)
#: The mark on the last entry a move puts in one inbox: "the rest of this batch is here".
BATCH_END = "+"



@dataclass(frozen=True)
class Run:
    variant: str
    k: int
    messages: int
    tuning: Tuning = BASELINE
    mode: str = "preload"     # preload | steady | latency-dispatch | latency-direct
    rate: float = 0.0         # steady: messages/s
    size: int = 600
    credit: int = 4
    refill_at: int = 2        # dispatcher: free credits a consumer needs before it is refilled
    dispatcher: str = "thread"   # thread (in consumer 0) | process
    root: str = "/dm"

    @property
    def dispatched(self) -> bool:
        return self.variant != "selfclaim" and self.mode != "latency-direct"

    @property
    def names(self) -> bool:
        return self.variant == "dispatch-names"


# -- names and paths: built here only ---------------------------------------------------
class Paths:
    def __init__(self, root: str) -> None:
        self.root = root
        self.unowned = f"{root}/unowned"
        self.owned = f"{root}/owned"
        self.consumers = f"{root}/consumers"
        self.offers = f"{root}/offers"

    @staticmethod
    def bucket_name(gen: int) -> str:
        return f"p0-{gen:010d}"

    def bucket(self, gen: int) -> str:
        return f"{self.unowned}/p0-{gen:010d}"

    def inbox(self, cid: str) -> str:
        return f"{self.owned}/{cid}"

    def liveness(self, cid: str) -> str:
        return f"{self.consumers}/{cid}"

    def message_prefix(self, gen: int, uid: str, names: bool) -> str:
        """A sequential create's prefix: a message with its body, or (names) an empty name."""
        return f"{self.bucket(gen)}/{'n' if names else 'm'}0-{gen:010d}-{uid}-"

    def body(self, gen: int, uid: str) -> str:
        return f"{self.bucket(gen)}/b-{uid}"

    def body_of(self, name: str) -> str:
        """The body of a moved name ``n0-{gen}-{uid}-{seq}[+]`` (dispatch-names)."""
        _, gen, uid, _ = name.split("-")
        return f"{self.unowned}/p0-{gen}/b-{uid}"

    def unowned_of(self, name: str) -> str:
        return f"{self.unowned}/p0-{name[3:13]}/{name}"


def consumer_ids(k: int) -> list[str]:
    return [f"c{index:02d}" for index in range(k)]


def seq_of(name: str) -> str:
    return name[-10:]


def make_body(index: int, size: int) -> bytes:
    """Index and publish time (monotonic ns, one clock for every process) first."""
    head = b"%08d%020d" % (index, time.monotonic_ns())
    return head + b"x" * (size - len(head))


def body_index(data: bytes) -> int:
    return int(data[:8])


def body_time(data: bytes) -> float:
    return int(data[8:28]) / 1e9


def make_client(hosts: str, tuning: Tuning) -> KazooClient:
    handler = wire.SelectHandler() if tuning.handler == "select" else None
    client = KazooClient(hosts=hosts, handler=handler, timeout=10.0)
    if tuning.buffered:
        wire.BufferedReads(client)   # before start: the handshake's reads go through it too
    client.start(timeout=30)
    return client


# -- what each process counts -----------------------------------------------------------
@dataclass
class Counts:
    writes: int = 0       # write transactions sent (publishing excluded)
    failed: int = 0       # of those, refused (a conflict, a missing node)
    reads: int = 0        # read requests (get, get_children, multiRead)
    gone_reads: int = 0   # reads that found the message already taken
    events: int = 0       # watch events handled
    moved: int = 0        # dispatcher: messages moved into inboxes
    ack_multis: int = 0   # of the writes, ack multis


@dataclass
class Report:
    """What a consumer process sends back."""

    index: int
    counts: Counts
    acked: list[int] = field(default_factory=list)
    last_ack: float = 0.0
    latencies: list[float] = field(default_factory=list)   # steady: publish -> held, ms
    dispatcher: Counts | None = None
    errors: list[str] = field(default_factory=list)
