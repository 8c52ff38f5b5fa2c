"""``celery zk ...``: celery_zk's commands, plugged into Celery's CLI.

Registered through the ``celery.commands`` entry point. Celery's root command
only creates a default app lazily, so ``celery zk server`` needs no ``-A``.
"""
from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import click

from .exceptions import CeleryZKError
from .ops.dead_letters import DeadLetters
from .ops.report import format_dead, format_status
from .ops.status import Status, collect
from .ops.status import queue_names as status_queue_names
from .ops.tree import export
from .server.launcher import ZooKeeperServer
from .zk.config import SCHEMES, mask_in_celery_reports, mask_password

# Celery imports this module (the celery.commands entry point) before it runs
# any command, `celery report` included.
mask_in_celery_reports()


class _StopRequested(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _StopRequested(signum)


@click.group()
def zk() -> None:
    """Apache ZooKeeper tools for celery_zk."""


@zk.command()
@click.option("--port", type=int, default=2181, show_default=True,
              help="Client port to listen on.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on.")
@click.option("--data-dir", type=click.Path(file_okay=False),
              help="Keep ZooKeeper's data here across runs (its log goes to DATA_DIR.log). "
                   "Default: a temporary directory, removed on exit.")
@click.option("--timeout", type=float, default=30, show_default=True,
              help="Seconds to wait for the server to answer ruok.")
def server(port: int, host: str, data_dir: str | None, timeout: float) -> None:
    """Run a local ZooKeeper server in the foreground (Ctrl-C stops it).

    Uses an installed ZooKeeper: $ZOOKEEPER_HOME, the Debian package, or Homebrew.
    """
    # SIGTERM must unwind like Ctrl-C so the java process is stopped, not orphaned.
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    zk_server: ZooKeeperServer | None = None
    try:
        zk_server = ZooKeeperServer(port=port, data_dir=data_dir, host=host)
        zk_server.start(timeout=timeout)
        where = "temporary, removed on exit" if data_dir is None else "kept"
        click.echo(f"ZooKeeper is ready: {zk_server.url}  (data: {zk_server.data_dir} "
                   f"[{where}], log: {zk_server.log_path})")
        click.echo("Point Celery at it (the path is your app's own chroot):")
        click.echo(f"    broker_url = '{zk_server.url}/myapp'")
        click.echo(f"    result_backend = '{zk_server.url}/myapp'")
        click.echo("Press Ctrl-C to stop.")
        while zk_server.running:
            time.sleep(0.5)
        raise click.ClickException(
            f"ZooKeeper exited unexpectedly. Last lines of {zk_server.log_path}:\n"
            f"{zk_server.read_log(last_lines=40)}")
    except _StopRequested as stop:
        click.echo(f"{stop}: stopping ZooKeeper...")
    except CeleryZKError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        # A second signal must not interrupt the cleanup and orphan java.
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        if zk_server is not None:
            zk_server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    click.echo("ZooKeeper stopped.")


# -- the operator's view: status, dead letters, metrics, tree ----------------------
def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{text} ({type(exc).__name__})" if type(exc).__name__ not in text else text


@contextmanager
def _clear_errors(what: str) -> Iterator[None]:
    """Every failure becomes one line on stderr and exit code 1."""
    from kazoo.exceptions import KazooException, NoAuthError

    try:
        yield
    except NoAuthError as exc:
        raise click.ClickException(
            f"{what}: ZooKeeper refused access (NoAuth): wrong user or password in the "
            "URL, or a user without read access") from exc
    except (CeleryZKError, KazooException, OSError, ConnectionError) as exc:
        raise click.ClickException(f"{what}: {_one_line(exc)}") from exc


def _not_zk(url: str) -> str:
    return (f"the broker is {mask_password(url)}, not zk://: give the app (celery -A proj "
            "zk ...) or the broker URL (celery -b zk://host:2181/path zk ...)")


@contextmanager
def _zk_broker(ctx: click.Context, timeout: float) -> Iterator[Any]:
    """The app's zk:// broker transport, connected (a clear error otherwise)."""
    from .broker.transport import Transport

    if not logging.getLogger().handlers:
        # kazoo's reconnect warnings would reach stderr through logging's last
        # resort; a command says what went wrong in one line of its own.
        logging.getLogger("kazoo").addHandler(logging.NullHandler())
    app = ctx.obj.app
    url = app.conf.broker_write_url or app.conf.broker_url
    if isinstance(url, str) and "://" in url and url.partition("://")[0] not in SCHEMES:
        # Before kombu loads that transport (which may need a package not installed).
        raise click.ClickException(_not_zk(url))
    conn = app.connection_for_write(connect_timeout=timeout)
    try:
        if not isinstance(conn.transport, Transport):
            raise click.ClickException(_not_zk(conn.as_uri()))
        with _clear_errors(f"cannot connect to {mask_password(conn.as_uri())}"):
            conn.transport.establish_connection()
        yield conn.transport
    finally:
        conn.release()


def _report(ctx: click.Context, transport: Any, queues: tuple[str, ...]) -> Status:
    from .backend.backend import ZooKeeperBackend

    app = ctx.obj.app
    backend = app.backend if str(app.conf.result_backend or "").startswith("zk") else None
    results_layout = results_client = expires = None
    if isinstance(backend, ZooKeeperBackend):
        results_layout, results_client = backend.layout, backend.client
        expires = float(backend.expires) if backend.expires else None
    known = set(status_queue_names(transport.handle.client, transport.layout))
    unknown = [queue for queue in queues if queue not in known]
    if unknown:
        raise click.ClickException(
            f"no queue {', '.join(map(repr, unknown))} under {transport.layout.root!r}; "
            f"queues there: {', '.join(sorted(known)) or 'none'}")
    options = transport.settings.options
    # The queues just listed: collect() need not list them again.
    return collect(transport.handle.client, transport.layout, transport.settings.hosts,
                   results_layout, expires, queues or known, results_client=results_client,
                   budget=(options.budget_nodes, options.budget_bytes))


#: Every command that talks to ZooKeeper takes it.
timeout_option = click.option("--timeout", type=float, default=5, show_default=True,
                              help="Seconds to wait for ZooKeeper.")


@zk.command()
@click.argument("queues", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="One JSON document, for scripts.")
@click.option("--watch", type=float, metavar="N", help="Refresh every N seconds.")
@timeout_option
@click.pass_context
def status(ctx: click.Context, queues: tuple[str, ...], as_json: bool, watch: float | None,
           timeout: float) -> None:
    """Queues, consumers, results and the servers' health, from names and stats.

    QUEUES: only these (default: every queue). Never reads message bodies, so it
    is cheap on a big backlog. --json --watch prints one JSON document per line.
    """
    with _zk_broker(ctx, timeout) as transport, _clear_errors("status"), \
            _whole_lines() as emit:
        try:
            while True:
                report = _report(ctx, transport, queues)
                if as_json:   # with --watch, one document per line (JSON lines)
                    emit(json.dumps(report.as_dict(), sort_keys=True,
                                    indent=None if watch else 2))
                else:
                    emit(format_status(report, transport.settings.sanitized_url()),
                         clear=bool(watch))
                if not watch:
                    return
                time.sleep(watch)
        except KeyboardInterrupt:
            return


@contextmanager
def _whole_lines() -> Iterator[Any]:
    """An ``emit(text)`` that Ctrl-C never cuts in half.

    A SIGINT that lands during a write used to stop it midway, so the last
    JSON line of ``status --json --watch`` was cut off and a reader's parser
    failed; here it waits until the text is written, then stops the loop.
    """
    state = {"writing": False, "pending": False}

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if state["writing"]:
            state["pending"] = True
        else:
            raise KeyboardInterrupt

    def emit(text: str, clear: bool = False) -> None:
        state["writing"] = True
        try:
            if clear:
                click.clear()
            click.echo(text)
        finally:
            state["writing"] = False
        if state["pending"]:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield emit
    finally:
        signal.signal(signal.SIGINT, previous)


@zk.group()
def dead() -> None:
    """List, requeue and purge a queue's dead letters."""


@contextmanager
def _dead_letters(ctx: click.Context, queue: str, timeout: float,
                  what: str) -> Iterator[DeadLetters]:
    """QUEUE's dead letters, on a connected broker; an unknown queue is an error."""
    with _zk_broker(ctx, timeout) as transport, _clear_errors(what):
        letters = DeadLetters(transport.queues, queue)
        letters.check_queue()
        yield letters


@dead.command("list")
@click.argument("queue")
@click.option("--json", "as_json", is_flag=True, help="One JSON document, for scripts.")
@timeout_option
@click.pass_context
def dead_list(ctx: click.Context, queue: str, as_json: bool, timeout: float) -> None:
    """The dead letters of QUEUE, with the reason each was set aside."""
    with _dead_letters(ctx, queue, timeout, "dead list") as dead_letters:
        letters = dead_letters.list()
        if as_json:
            click.echo(json.dumps([letter.as_dict() for letter in letters], indent=2))
            return
        click.echo(format_dead(queue, letters))


@dead.command("requeue")
@click.argument("queue")
@click.argument("ids", nargs=-1)
@click.option("--all", "every", is_flag=True, help="Every dead letter of the queue.")
@timeout_option
@click.pass_context
def dead_requeue(ctx: click.Context, queue: str, ids: tuple[str, ...], every: bool,
                 timeout: float) -> None:
    """Put dead letters of QUEUE back where they waited (one transaction each).

    IDS: as `celery zk dead list` shows them; or --all.
    """
    if bool(ids) == every:
        raise click.UsageError("give the dead letters' IDS, or --all (not both)")
    with _dead_letters(ctx, queue, timeout, "dead requeue") as letters:
        names = letters.ids() if every else list(ids)
        if len(names) == 1 and not every:   # one asked for: its error is the error
            click.echo(f"requeued {names[0]} -> {queue} ({letters.requeue(names[0])})")
            return
        failed = 0
        for name in names:
            try:
                new_name = letters.requeue(name)
            except CeleryZKError as exc:
                failed += 1
                click.echo(f"not requeued: {exc}", err=True)
            else:
                click.echo(f"requeued {name} -> {queue} ({new_name})")
        if every and not failed:
            click.echo(f"queue {queue!r} has {len(letters.ids())} dead letters left")
        if failed:
            raise click.ClickException(f"{failed} dead letter(s) of {queue!r} not requeued")


@dead.command("purge")
@click.argument("queue")
@click.option("-f", "--force", is_flag=True, help="Do not ask for confirmation.")
@timeout_option
@click.pass_context
def dead_purge(ctx: click.Context, queue: str, force: bool, timeout: float) -> None:
    """Delete every dead letter of QUEUE."""
    with _dead_letters(ctx, queue, timeout, "dead purge") as letters:
        count = len(letters.ids())
        if count and not force:
            click.confirm(f"Delete {count} dead letter(s) of queue {queue!r}?", abort=True)
        click.echo(f"purged {letters.purge()} dead letter(s) of queue {queue!r}")


@zk.command()
@click.option("--port", type=int, default=9808, show_default=True)
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to listen on.")
@timeout_option
@click.pass_context
def exporter(ctx: click.Context, port: int, addr: str, timeout: float) -> None:
    """Serve Prometheus metrics of the queues, consumers and servers (/metrics).

    celery_queue_length{queue_name} and celery_active_consumer_count{queue_name}
    as celery-exporter names them, plus celery_zk_* (see docs/operations.md).
    """
    from prometheus_client import CollectorRegistry, start_http_server

    from .ops.exporter import StatusCollector

    with _zk_broker(ctx, timeout) as transport, _clear_errors("exporter"):
        registry = CollectorRegistry()
        registry.register(StatusCollector(lambda: _report(ctx, transport, ())))
        start_http_server(port, addr=addr, registry=registry)
        click.echo(f"celery_zk exporter: http://{addr}:{port}/metrics for "
                   f"{transport.settings.sanitized_url()}  (Ctrl-C stops it)")
        previous = signal.signal(signal.SIGTERM, _raise_stop)
        try:
            while True:
                time.sleep(3600)
        except (KeyboardInterrupt, _StopRequested):
            click.echo("exporter stopped")
        finally:
            signal.signal(signal.SIGTERM, previous)


@zk.command()
@click.argument("path", default="")
@click.option("--data", is_flag=True, help="Include each node's data (messages, results).")
@timeout_option
@click.pass_context
def tree(ctx: click.Context, path: str, data: bool, timeout: float) -> None:
    """The celery_zk tree as JSON with ACLs, for support; never a password.

    PATH: under the broker's root (e.g. queues/celery); default: the whole root.
    """
    from kazoo.exceptions import NoNodeError

    with _zk_broker(ctx, timeout) as transport, _clear_errors("tree"):
        root = transport.layout.root
        full = "/" + "/".join(p for p in (root.strip("/"), path.strip("/")) if p)
        try:
            click.echo(json.dumps(export(transport.handle.client, full, data), indent=2))
        except NoNodeError:
            raise click.ClickException(f"no node {full!r} (PATH is under the broker's "
                                       f"root {root!r})") from None


@zk.command()
@timeout_option
@click.pass_context
def upgrade(ctx: click.Context, timeout: float) -> None:
    """Store messages kept by celery_zk before 0.2 as this release does.

    Run it once after upgrading, with the old release's workers and
    publishers stopped: until then their messages wait undelivered (a worker
    logs which queue holds them). Running it again finds nothing to do.
    """
    from .ops.upgrade import upgrade as run_upgrade

    with _zk_broker(ctx, timeout) as transport, _clear_errors("upgrade"):
        done = run_upgrade(transport.queues)
    for queue, count in sorted(done.moved.items()):
        click.echo(f"{queue}: {count} message(s) stored anew")
    for queue, count in sorted(done.owned_by_live.items()):
        click.echo(f"{queue}: {count} message(s) left, owned by a live worker of the old "
                   "release: stop it and run the upgrade again")
    if not done.moved and not done.owned_by_live:
        click.echo("nothing to upgrade")


@zk.group()
def limit() -> None:
    """Cluster-wide rate and concurrency limits (see docs/features.md).

    TARGET is a task's name, or queue:NAME for a queue's rate. A change is
    followed by every dispatcher at once, without a restart; a worker that
    starts writes its app's zk_rate_limits and zk_concurrency_limits again.
    """


@limit.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON document, for scripts.")
@timeout_option
@click.pass_context
def limit_list(ctx: click.Context, as_json: bool, timeout: float) -> None:
    """Every limit, its use now, and what waits on it."""
    from .ops.limits import limit_statuses
    from .ops.report import format_limits

    with _zk_broker(ctx, timeout) as transport, _clear_errors("limit list"):
        client = transport.handle.client
        statuses = limit_statuses(client, transport.layout,
                                  status_queue_names(client, transport.layout))
    if as_json:
        click.echo(json.dumps([s.as_dict() for s in statuses], indent=2))
    else:
        click.echo(format_limits(statuses) if statuses else "no limits")


@limit.command("set")
@click.argument("target")
@click.option("--rate", help="At most this many, Celery's syntax: 20/m, 5/s, 100/h.")
@click.option("--concurrency", type=int, help="At most this many owned at once.")
@click.option("--key", help="Concurrency per key: a template over the task's arguments, "
                            "e.g. '{customer_id}' (applied where tasks are published).")
@timeout_option
@click.pass_context
def limit_set(ctx: click.Context, target: str, rate: str | None, concurrency: int | None,
              key: str | None, timeout: float) -> None:
    """Set (or replace) the limit on TARGET."""
    from .features.limits import Limit, LimitStore, limit_target
    from .ops.limits import parse_limit_options

    with _clear_errors("limit set"):
        try:
            new = Limit(*limit_target(target), **parse_limit_options(rate, concurrency, key))
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    with _zk_broker(ctx, timeout) as transport, _clear_errors("limit set"):
        LimitStore(transport.handle.client, transport.layout).set(new)
    click.echo(f"limit on {target}: " + ", ".join(
        f"{k} {v}" for k, v in (("rate", rate), ("concurrency", concurrency), ("key", key))
        if v is not None))


@limit.command("clear")
@click.argument("target")
@timeout_option
@click.pass_context
def limit_clear(ctx: click.Context, target: str, timeout: float) -> None:
    """Remove the limit on TARGET."""
    from .features.limits import LimitStore, limit_target

    kind, name = limit_target(target)
    with _zk_broker(ctx, timeout) as transport, _clear_errors("limit clear"):
        found = LimitStore(transport.handle.client, transport.layout).clear(kind, name)
    if not found:
        raise click.ClickException(f"no limit on {target}; `celery zk limit list` shows them")
    click.echo(f"limit on {target} cleared")
