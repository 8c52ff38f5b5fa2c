"""The private names of kazoo, Celery and kombu celery_zk uses, fenced in
``celery_zk/compat/``: each is there in the installed release (every cell of the
test matrix runs this), a changed one is named clearly, and where a fallback
exists it is taken."""
from __future__ import annotations

import ast
import logging
from pathlib import Path
from typing import Any

import pytest

from celery_zk.compat import PrivateAPIChanged, celery_pool
from celery_zk.compat import celery as celery_compat
from celery_zk.compat import kazoo as kazoo_compat
from celery_zk.compat import kombu as kombu_compat

PACKAGE = Path(__file__).resolve().parents[2] / "celery_zk"

#: Every private name of a dependency celery_zk touches; only compat/ may.
FENCED = {
    "_call", "_read_watch_event", "_connection", "_data_watchers", "_child_watchers",
    "_socket", "_read", "_socket_error_handling",
    "_apply_tasks", "_regen", "sanitize_url", "maybe_sanitize_url",
    "_delivered", "_dirty", "_flush", "_quick_ack", "_on_collect", "_active_queues",
    "_tag_to_queue", "_get_message_priority", "_deliver",
}


@pytest.mark.parametrize("module", [kazoo_compat, celery_compat, celery_pool, kombu_compat],
                         ids=["kazoo", "celery", "celery_pool", "kombu"])
def test_the_installed_release_has_every_fenced_name(module: Any) -> None:
    problems = module.missing()
    assert not problems, "\n".join(problems)


def test_a_quota_refusal_is_quota_exceeded_on_every_kazoo() -> None:
    """kazoo 2.9 has no class for the server's -125; the fence registers one."""
    from kazoo.exceptions import EXCEPTIONS

    assert issubclass(EXCEPTIONS[-125], kazoo_compat.QuotaExceededError)


def test_instances_have_the_fenced_attributes() -> None:
    """Attributes set by ``__init__`` (a kombu channel's: see test_transport_kombu)."""
    from celery import Celery
    from kazoo.client import KazooClient

    assert not kazoo_compat.missing(KazooClient()), kazoo_compat.missing(KazooClient())
    app = Celery("compat", backend="zk://127.0.0.1:1/compat", set_as_current=False)
    assert not celery_compat.missing(app.backend), celery_compat.missing(app.backend)


def test_no_module_outside_compat_touches_a_fenced_name() -> None:
    for path in PACKAGE.rglob("*.py"):
        if "compat" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                assert node.attr not in FENCED, (
                    f"{path.relative_to(PACKAGE)}:{node.lineno} reads .{node.attr}: "
                    "private names of dependencies go through celery_zk/compat/")


# -- a changed release: named, and the fallback taken ------------------------------
def test_kazoo_without_its_connection_internals_is_named_and_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without persistent watches a consumer has nothing to wait on: a transport
    refuses to start, naming the release and the name."""
    from kazoo.client import KazooClient
    from kazoo.protocol.connection import ConnectionHandler

    monkeypatch.delattr(ConnectionHandler, "_read_watch_event")
    [problem] = kazoo_compat.missing()
    assert "kazoo" in problem and "ConnectionHandler._read_watch_event" in problem
    assert "cannot wait for messages" in problem
    with pytest.raises(PrivateAPIChanged, match="_read_watch_event"):
        kazoo_compat.intercept_watch_events(KazooClient(), lambda kind, path: False)
    with pytest.raises(PrivateAPIChanged, match="_read_watch_event"):
        kazoo_compat.require()


def test_kazoo_without_call_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from kazoo.client import KazooClient

    monkeypatch.delattr(KazooClient, "_call")
    assert any("KazooClient._call" in p for p in kazoo_compat.missing())
    with pytest.raises(PrivateAPIChanged, match="KazooClient._call"):
        kazoo_compat.send(KazooClient(), object())


def test_kazoo_without_its_reads_keeps_kazoos_own(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Buffered reads are speed, not function: without the names kazoo reads as
    it always did, said once in the log and by ``missing``."""
    from kazoo.client import KazooClient
    from kazoo.protocol.connection import ConnectionHandler

    from celery_zk.zk.handler import PollingHandler

    client = KazooClient(handler=PollingHandler())
    assert kazoo_compat.buffer_reads(client)
    assert isinstance(client._connection._read, kazoo_compat._BufferedReads)
    # kazoo's own handler waits on the socket itself: never given our reads.
    assert kazoo_compat.buffer_reads(KazooClient()) is False
    monkeypatch.delattr(ConnectionHandler, "_socket_error_handling")
    monkeypatch.setattr(kazoo_compat, "_told", [])
    other = KazooClient(handler=PollingHandler())
    own = other._connection._read
    with caplog.at_level(logging.WARNING, logger="celery_zk.compat.kazoo"):
        assert kazoo_compat.buffer_reads(other) is False
        assert kazoo_compat.buffer_reads(other) is False
    assert other._connection._read == own
    assert caplog.text.count("two steps") == 1
    [problem] = kazoo_compat.missing()
    assert "ConnectionHandler._socket_error_handling" in problem and "two steps" in problem


def test_a_changed_group_apply_tasks_is_left_alone(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    from celery.canvas import group

    def _apply_tasks(self: Any, tasks: Any, app: Any = None) -> Any:   # not a generator
        return []

    monkeypatch.setattr(group, "_apply_tasks", _apply_tasks)
    with caplog.at_level(logging.WARNING, logger="celery_zk.compat.celery"):
        assert celery_compat.wrap_group_apply_tasks(lambda original: original) is False
    assert group._apply_tasks is _apply_tasks
    assert "published task by task" in caplog.text and "celery" in caplog.text
    assert any("group._apply_tasks" in p for p in celery_compat.missing())


def test_group_batching_wraps_celerys_apply_tasks() -> None:
    from celery.canvas import group

    import celery_zk  # noqa: F401  (installs the wrapper)

    assert getattr(group._apply_tasks, "_celery_zk", False)
    assert celery_compat.missing() == []   # the wrapped one still passes the check


def test_url_masking_without_celerys_function_falls_back(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from celery.app import utils

    for name in celery_compat.URL_MASKERS:
        monkeypatch.delattr(utils, name, raising=False)
    with caplog.at_level(logging.WARNING, logger="celery_zk.compat.celery"):
        assert celery_compat.wrap_url_masking(str.upper, frozenset({"zk"})) is False
    assert "user:password@" in caplog.text
    assert any("sanitize_url" in p for p in celery_compat.missing())


def test_url_masking_masks_zk_query_passwords_with_either_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from celery.app import utils

    from celery_zk.zk.config import mask_password

    for name in celery_compat.URL_MASKERS:
        monkeypatch.delattr(utils, name, raising=False)

    def celery_mask(url: Any, mask: str = "*" * 8) -> Any:
        return f"celery masked {url}"

    for name in celery_compat.URL_MASKERS:   # Celery 5.7's name, then the older one
        monkeypatch.setattr(utils, name, celery_mask, raising=False)
        assert celery_compat.wrap_url_masking(mask_password, frozenset({"zk"}))
        masked = getattr(utils, name)
        assert masked("zk://h/x?read_only_users=bob:pw", mask="*" * 8) == (
            "zk://h/x?read_only_users=bob:**")
        assert masked("redis://h", mask="*" * 8) == "celery masked redis://h"
        monkeypatch.delattr(utils, name)


def test_lazy_headers_without_celerys_regen_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery.utils import functional

    generated = functional.regen(iter([1, 2]))
    assert celery_compat.is_lazy(generated) and not celery_compat.is_lazy([1, 2])
    monkeypatch.delattr(functional, "_regen")
    assert celery_compat.is_lazy(generated)
    assert not celery_compat.is_lazy([1, 2]) and not celery_compat.is_lazy((1, 2))
    assert any("_regen" in p for p in celery_compat.missing())


def test_kombu_without_a_qos_internal_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from kombu.transport import virtual

    monkeypatch.delattr(virtual.QoS, "_flush")
    monkeypatch.setattr(kombu_compat, "_checked", False)
    with pytest.raises(PrivateAPIChanged) as excinfo:
        kombu_compat.require()
    assert "kombu" in str(excinfo.value) and "virtual.QoS._flush" in str(excinfo.value)
    assert "cannot run on this kombu" in str(excinfo.value)


@pytest.fixture
def no_start_gate() -> Any:
    """No gate of a transport an earlier test ran in a worker (its session is
    closed, so it refuses every start): process-wide, like the hook."""
    before = celery_pool._start_gate
    celery_pool.gate_thread_task_starts(None)
    yield
    celery_pool.gate_thread_task_starts(before)


@pytest.mark.usefixtures("no_start_gate")
def test_a_thread_pool_flush_drops_what_it_has_not_started() -> None:
    """Celery's real thread pool: one task runs, two wait; the flush Celery calls
    on a lost connection cancels the two, the running one finishes."""
    import threading

    from celery.concurrency import thread

    assert celery_pool.flush_unstarted_thread_tasks()
    assert celery_pool.flush_unstarted_thread_tasks()   # idempotent
    pool = thread.TaskPool(limit=1)
    pool.start()
    release, ran = threading.Event(), []
    try:
        started = threading.Event()
        first = pool.apply_async(lambda: (started.set(), release.wait(10), ran.append("first")))
        assert started.wait(10)
        queued = [pool.apply_async(lambda i=i: ran.append(i)) for i in range(2)]
        pool.flush()
        release.set()
        first.wait(10)
        for result in queued:
            assert result.f.cancelled()
        assert ran == ["first"]
        later = pool.apply_async(lambda: ran.append("later"))   # the pool goes on
        later.wait(10)
        assert ran == ["first", "later"]
        # The transport's drop, the instant its session is lost: every pool's.
        release.clear()
        running = threading.Event()
        blocker = pool.apply_async(lambda: (running.set(), release.wait(10)))
        assert running.wait(10)
        waiting = [pool.apply_async(lambda: ran.append("dropped")) for _ in range(3)]
        assert celery_pool.drop_unstarted_thread_tasks() == 3
        release.set()
        blocker.wait(10)
        assert all(result.f.cancelled() for result in waiting)
        assert ran == ["first", "later"]
    finally:
        release.set()
        pool.stop()


def test_a_thread_pool_asks_the_start_gate_before_each_task() -> None:
    """Celery's real thread pool with the start gate hooked in: the ticket is
    taken when the task is handed over, the gate asked in the pool thread; a
    refused task runs neither itself nor Celery's accept and done callbacks."""
    from celery.concurrency import thread

    class Gate:
        def __init__(self) -> None:
            self.tickets = iter(range(100))
            self.refuse: set[int] = set()
            self.asked: list[int] = []

        def ticket(self, delivery_tag: str | None) -> int:
            assert delivery_tag is None   # these accept callbacks are no Request's
            return next(self.tickets)

        def admit(self, ticket: int, read_at: float | None = None) -> bool:
            self.asked.append(ticket)
            return ticket not in self.refuse

    assert celery_pool.flush_unstarted_thread_tasks()
    gate = Gate()
    gate.refuse = {1}
    celery_pool.gate_thread_task_starts(gate)
    pool = thread.TaskPool(limit=1)
    pool.start()
    events: list[tuple[str, int]] = []
    try:
        results = [pool.apply_async(lambda i=i: events.append(("ran", i)),
                                    callback=lambda _, i=i: events.append(("done", i)),
                                    accept_callback=lambda *_, i=i: events.append(("accepted", i)))
                   for i in range(3)]
        for result in results:
            result.wait(10)
        assert gate.asked == [0, 1, 2]
        assert events == [("accepted", 0), ("ran", 0), ("done", 0),
                          ("accepted", 2), ("ran", 2), ("done", 2)]
        assert isinstance(results[1].f.exception(), celery_pool.StartRefused)
        # Without an accept callback of Celery's the gate is asked all the same.
        pool.apply_async(lambda: events.append(("ran", 3))).wait(10)
        assert gate.asked[-1] == 3 and events[-1] == ("ran", 3)
    finally:
        celery_pool.gate_thread_task_starts(None)
        pool.stop()


def test_the_start_gate_is_told_the_delivery_tag_of_celerys_request() -> None:
    """Celery passes its Request's bound ``on_accepted``; the gate gets the
    request's message's delivery tag (the fenced names, on Celery's real pool)."""
    from types import SimpleNamespace

    from celery.concurrency import thread
    from celery.worker.request import Request

    tags: list[str | None] = []

    class Gate:
        def ticket(self, delivery_tag: str | None) -> None:
            tags.append(delivery_tag)

        def admit(self, ticket: None, read_at: float | None = None) -> bool:
            tags.append(f"read at {read_at}")
            return True

    class FakeRequest:   # Celery's Request has these three, checked below
        message = SimpleNamespace(delivery_tag="/root/queues/q/owned/c1/n5-1",
                                  properties={celery_pool.READ_AT: 5.0})

        def __init__(self, revoked: bool = False) -> None:
            self.is_revoked = revoked

        def on_accepted(self, pid: int, time_accepted: float) -> None:
            tags.append("accepted")

        def revoked(self) -> bool:
            return self.is_revoked

    assert isinstance(Request.message, property) and callable(Request.on_accepted)
    assert callable(Request.revoked)
    assert celery_pool.flush_unstarted_thread_tasks()
    celery_pool.gate_thread_task_starts(Gate())
    pool = thread.TaskPool(limit=1)
    pool.start()
    try:
        pool.apply_async(lambda: tags.append("ran"),
                         accept_callback=FakeRequest().on_accepted).wait(10)
        assert tags == ["/root/queues/q/owned/c1/n5-1", "read at 5.0", "accepted", "ran"]
        # Revoked while it waited in the pool: not started.
        tags.clear()
        result = pool.apply_async(lambda: tags.append("ran"),
                                  accept_callback=FakeRequest(revoked=True).on_accepted)
        result.wait(10)
        assert tags == ["/root/queues/q/owned/c1/n5-1", "read at 5.0"]
        assert isinstance(result.f.exception(), celery_pool.StartRefused)
    finally:
        celery_pool.gate_thread_task_starts(None)
        pool.stop()


def test_a_thread_pool_whose_on_apply_changed_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery.concurrency import thread

    def on_apply(self: object, target: object, **options: object) -> None: ...

    monkeypatch.setattr(thread.TaskPool, "on_apply", on_apply)
    assert any("on_apply(self, target, args, kwargs, callback, accept_callback)" in problem
               for problem in celery_pool.missing())


def test_a_thread_pool_without_on_apply_is_named(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    from celery.concurrency import thread

    monkeypatch.delattr(thread, "ApplyResult")
    assert any("ApplyResult" in problem for problem in celery_pool.missing())
    with caplog.at_level(logging.WARNING):
        assert not celery_pool.flush_unstarted_thread_tasks()
    assert "thread pool" in caplog.text


def test_a_prefork_hand_over_goes_through_the_starter_with_celerys_tracer_arguments() -> None:
    """Celery's own Request hands a task to its prefork pool; the child is told to
    call our starter with the stamp and the tracer's arguments (task name, id,
    request dict, ...), the fenced shape."""
    from celery import Celery
    from celery.concurrency import base, prefork
    from celery.contrib.testing.mocks import TaskMessage
    from celery.worker.request import Request

    app = Celery("compat", set_as_current=False)

    @app.task(name="compat.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    def starter(*args: Any) -> None: ...

    handed: list[tuple[Any, tuple[Any, ...]]] = []
    pool = prefork.TaskPool(1, app=app)
    pool.on_apply = lambda target, args, kwargs, **options: handed.append((target, args))
    hand_over = celery_pool.hand_prefork_tasks_through
    assert hand_over(starter, lambda read_at: (1.5, False, "/root"))
    try:
        assert hand_over(starter, lambda read_at: (2.5, True, read_at))
        # A connection that does not consume installs, and replaces nothing.
        assert hand_over(starter, lambda read_at: (9.5, True, "/other"), replace=False)
        message = TaskMessage("compat.add", "id-1", args=(1, 2))
        message.properties = {celery_pool.READ_AT: 7.0}   # set by the zk transport
        request = Request(message, app=app, task=add)
        request.execute_using_pool(pool)
        [(target, args)] = handed
        assert target is starter
        tracer, stamp, (name, task_id, request_dict) = args[0], args[1:4], args[4:7]
        assert callable(tracer) and stamp == (2.5, True, 7.0)   # the last replacing stamp
        assert (name, task_id) == ("compat.add", "id-1") and isinstance(request_dict, dict)
        # Anything but a tracer's arguments is handed over as it is.
        handed.clear()
        pool.apply_async(print, args=("x",))
        assert handed == [(print, ("x",))]
    finally:
        del prefork.TaskPool.apply_async
        celery_pool._prefork_stamp = None
    assert prefork.TaskPool.apply_async is base.BasePool.apply_async


def test_a_prefork_pool_whose_apply_async_changed_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from celery.concurrency import prefork

    monkeypatch.setattr(prefork.TaskPool, "apply_async", lambda self, *a, **k: None)
    assert any("prefork.TaskPool overrides apply_async" in problem
               for problem in celery_pool.missing())
    assert not celery_pool.hand_prefork_tasks_through(print, lambda read_at: ())
    assert celery_pool._prefork_stamp is None


def test_a_connect_is_aborted_only_where_a_socket_is() -> None:
    """abort_connect shuts down the connection's socket (a stop no longer
    waits for a connect reply that never comes); a client never connected has
    none, and says so."""
    import socket

    from kazoo.client import KazooClient

    client = KazooClient()
    assert kazoo_compat.abort_connect(client) is False
    left, right = socket.socketpair()
    try:
        client._connection._socket = left
        assert kazoo_compat.abort_connect(client) is True
        assert right.recv(1) == b""   # the other end sees the shutdown
    finally:
        client._connection._socket = None
        left.close()
        right.close()


def test_pool_slots_are_the_pool_size_of_this_processs_worker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from celery import Celery
    from celery.concurrency import prefork, thread

    monkeypatch.setattr(celery_pool, "_worker", None)
    assert celery_pool.pool_slots() == 1   # no worker in this process

    class Worker:   # what worker_init sends: a WorkController
        concurrency = 3
        pool: Any = None

    worker = Worker()
    celery_pool.record_worker(worker)
    assert celery_pool.pool_slots() == 3   # its pool not made yet
    worker.pool = thread.TaskPool(limit=5)
    assert celery_pool.pool_slots() == 5
    worker.pool = prefork.TaskPool(limit=2, app=Celery(set_as_current=False))
    assert celery_pool.pool_slots() == 3   # not started: no processes to count yet
    del worker
    assert celery_pool.pool_slots() == 1   # kept weakly


def test_a_pool_without_num_processes_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery.concurrency import base

    monkeypatch.delattr(base.BasePool, "num_processes")
    assert any("BasePool.num_processes" in problem for problem in celery_pool.missing())


def test_task_ends_are_told_around_a_pools_callbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """track_task_ends: the listener hears a task's acceptance before Celery's
    on_accepted and its end before Celery's callback, by delivery tag; a
    pool's own apply without a request is left alone."""
    from celery.concurrency import base, thread

    monkeypatch.setattr(base.BasePool, "apply_async", base.BasePool.apply_async)
    heard: list[tuple[str, str]] = []

    class Listener:
        def wants(self, tag: str) -> bool:
            return tag.endswith("n0")

        def accepted(self, tag: str) -> None:
            heard.append(("accepted", tag))

        def ended(self, tag: str) -> None:
            heard.append(("ended", tag))

    class Request:   # what Celery passes: its bound on_accepted, its message
        message = type("Message", (), {"delivery_tag": "/q/owned/c1/n0"})()

        def on_accepted(self, pid: Any, time_accepted: float) -> None:
            heard.append(("on_accepted", ""))

    assert celery_pool.track_task_ends(Listener())
    assert celery_pool.track_task_ends(Listener())   # idempotent
    pool = thread.TaskPool(limit=1)
    pool.start()
    try:
        done = pool.apply_async(lambda: 42, accept_callback=Request().on_accepted,
                                callback=lambda value: heard.append(("callback", value)))
        done.f.result(10)
        pool.apply_async(lambda: 1, callback=lambda value: None).f.result(10)   # no request
        unwanted = Request()
        unwanted.message = type("Message", (), {"delivery_tag": "/q/owned/c1/n1"})()
        pool.apply_async(lambda: 2, accept_callback=unwanted.on_accepted,
                         callback=lambda value: None).f.result(10)   # not wanted: untold
    finally:
        pool.stop()
    assert heard == [("accepted", "/q/owned/c1/n0"), ("on_accepted", ""),
                     ("ended", "/q/owned/c1/n0"), ("callback", 42), ("on_accepted", "")]
    # What the wrapper passes on still leads to the Request (the start gate and
    # the prefork hand-over find it there; the revoke check needs it).
    request = Request()
    assert celery_pool._First(print, "t", request.on_accepted).__self__ is request
    assert not celery_pool.missing()


def test_a_pool_whose_apply_async_changed_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery.concurrency import base

    def apply_async(self: Any, target: Any, *args: Any) -> None: ...

    monkeypatch.setattr(base.BasePool, "apply_async", apply_async)
    assert any("BasePool.apply_async" in problem for problem in celery_pool.missing())
    assert not celery_pool.track_task_ends(object())   # type: ignore[arg-type]


def test_slots_hear_an_end_before_its_acceptance() -> None:
    """billiard may report a task's end before its acceptance: the acceptance
    that follows starts nothing, so the early ack after it is a plain one."""
    from celery_zk.broker.slots import Slots

    slots = Slots()
    slots.ended("/q/owned/c1/n0")
    slots.accepted("/q/owned/c1/n0")
    assert slots.ack(object(), "/q/owned/c1/n0", "/consumers/c1") is False
    slots.accepted("/q/owned/c1/n1")
    slots.ended("/q/owned/c1/n1")
    assert slots.ack(object(), "/q/owned/c1/n1", "/consumers/c1") is False
