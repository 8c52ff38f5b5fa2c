"""``celery zk ...``: celery_zk's commands, plugged into Celery's CLI.

Registered through the ``celery.commands`` entry point. Celery's root command
only creates a default app lazily, so ``celery zk server`` needs no ``-A``.
"""
from __future__ import annotations

import signal
import time
from types import FrameType

import click

from .config import mask_in_celery_reports
from .exceptions import CeleryZKError
from .server import ZooKeeperServer

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
