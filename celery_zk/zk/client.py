"""Making kazoo clients from :class:`~celery_zk.zk.config.ZKSettings`, and the
request helpers every module shares (retries, lost replies, listings and
deletes of nodes that may be gone, replies nobody waits for).

Nothing but :mod:`celery_zk.zk.session` makes clients: it shares one per process.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from time import monotonic
from typing import Any, Callable, Generic, TypeVar

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    ConnectionClosedError,
    ConnectionLoss,
    NoAuthError,
    NoNodeError,
    OperationTimeoutError,
    RolledBackError,
    RuntimeInconsistency,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.serialization import Auth
from kazoo.protocol.states import KeeperState
from kazoo.retry import KazooRetry, RetryFailedError
from kazoo.security import OPEN_ACL_UNSAFE, make_digest_acl

from ..compat import kazoo as kazoo_compat
from ..exceptions import ZKAuthError, ZKConfigurationError, ZKConnectionError
from .config import ZKSettings
from .handler import PollingHandler

logger = logging.getLogger(__name__)


class _MaskAuth(logging.Filter):
    """kazoo logs every request it sends at DEBUG, the digest ``Auth`` packet
    (``user:password``) included: mask the password before any handler sees it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(a, Auth) for a in record.args):
            record.args = tuple(
                a._replace(auth=a.auth.partition(":")[0] + ":**") if isinstance(a, Auth)
                else a for a in record.args)
        return True


#: kazoo's own logger (the one users configure), with the mask on it.
_KAZOO_LOGGER = logging.getLogger("kazoo.client")
if not any(isinstance(f, _MaskAuth) for f in _KAZOO_LOGGER.filters):
    _KAZOO_LOGGER.addFilter(_MaskAuth())


def node_acl(settings: ZKSettings) -> list[Any]:
    """The ACL every node celery_zk creates gets."""
    opts = settings.options
    if opts.acl not in ("auto", "open"):
        raise ZKConfigurationError(
            f"celery_zk option 'acl' must be 'auto' or 'open', not {opts.acl!r}.")
    if opts.acl == "open" or not settings.username:
        return list(OPEN_ACL_UNSAFE)
    acl = [make_digest_acl(settings.username, settings.password or "", all=True)]
    for pair in filter(None, (p.strip() for p in opts.read_only_users.split(","))):
        user, sep, password = pair.partition(":")
        if not sep or not user:
            raise ZKConfigurationError(
                f"read_only_users entry {user or pair!r} must be user:password.")
        acl.append(make_digest_acl(user, password, read=True))
    return acl


def make_client(settings: ZKSettings, connect_timeout: float | None = None) -> KazooClient:
    """A started, authenticated client (``connect_timeout``: seconds, default the
    settings' ``connect_timeout``). Use :class:`celery_zk.zk.session.ClientHandle`
    rather than this: it shares one client per process."""
    opts = settings.options
    timeout = opts.connect_timeout if connect_timeout is None else connect_timeout
    kwargs: dict[str, Any] = {}
    if opts.use_ssl:
        kwargs.update(use_ssl=True, verify_certs=opts.verify_certs)
        for name in ("ca", "certfile", "keyfile", "keyfile_password"):
            value = getattr(opts, name)
            if value:
                kwargs[name] = value
    auth = ([("digest", f"{settings.username}:{settings.password or ''}")]
            if settings.username else None)
    client = KazooClient(
        hosts=settings.hosts,
        timeout=opts.session_timeout,
        default_acl=node_acl(settings),
        auth_data=auth,
        logger=_KAZOO_LOGGER,
        connection_retry=KazooRetry(max_tries=-1, max_delay=2.0),
        command_retry=KazooRetry(max_tries=10, delay=0.05, max_delay=2.0, deadline=max(
            opts.session_timeout, 5.0)),
        # ZooKeeper grants the timeout asked for within its bounds (4 to 40 s
        # by default): two thirds of it is what a server may leave us unanswered.
        handler=PollingHandler(silence=opts.session_timeout * 2 / 3),
        **kwargs,
    )
    kazoo_compat.buffer_reads(client)   # many packets per recv(); kazoo's reads if it cannot
    why = _start(client, settings.hosts, timeout,
                 fail_fast=settings.hosts not in _reached)
    if why is None:
        _reached.add(settings.hosts)
    else:
        # kazoo's stop() waits for its connection thread, which may sit in a
        # connect attempt to a host that never answers for up to 10 s more:
        # the caller is told now, the client is disposed of in the background.
        dispose_later(client)
        raise ZKConnectionError(
            f"Could not connect to ZooKeeper at {settings.hosts}: {why}. Is the server "
            "running and reachable? (For a local one: `celery zk server`.) Raise "
            f"'connect_timeout' for a slow network. {_tls_hint(settings)}")
    return client


def dispose_later(client: KazooClient) -> None:
    """Stop and close ``client`` in the background: kazoo's stop() waits for its
    connection thread, which may sit in a connect attempt for seconds."""
    threading.Thread(target=_dispose, args=(client,), name="celery_zk-dispose",
                     daemon=True).start()


def _dispose(client: KazooClient) -> None:
    try:
        client.stop()
        client.close()
    except Exception:   # an abandoned client: nothing depends on how it ends
        logger.debug("celery_zk: disposing of a client that never connected failed",
                     exc_info=True)


#: How long a first connection may fail before we look whether anything listens.
_PROBE_AFTER = 0.2
#: Hosts this process has had a session with. A server that refuses them now is
#: restarting or failing over: a new session waits connect_timeout for it, as
#: kazoo's own reconnect does, instead of failing at once like a first contact.
_reached: set[str] = set()


def _start(client: KazooClient, hosts: str, timeout: float,
           fail_fast: bool = True) -> str | None:
    """Start ``client``; None once connected, else why not.

    kazoo retries a refused connection until the timeout. On a first contact
    (``fail_fast``), when nothing listens on any of the hosts (refused, or no
    such host) waiting cannot help, so that is said at once, as a TCP client
    would (kombu's connect() retries after 2 s, and Celery's
    broker_connection_timeout is 4 s). The look is a plain TCP connect, made
    only after kazoo's own attempt has not succeeded.
    """
    deadline = monotonic() + timeout
    connected = client.start_async()
    if connected.wait(min(_PROBE_AFTER, timeout)) and client.connected:
        return None
    refused = (_nothing_listens(hosts, max(0.05, min(1.0, deadline - monotonic())))
               if fail_fast else None)
    if refused:
        return refused
    connected.wait(max(0.0, deadline - monotonic()))
    return None if client.connected else f"no session within {timeout:g}s"


def _nothing_listens(hosts: str, timeout: float) -> str | None:
    """``connection refused`` (or the lookup failure) when no host accepts TCP."""
    reasons = []
    for host_port in hosts.split(","):
        host, _, port = host_port.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
            return None
        except ConnectionRefusedError:
            reasons.append("connection refused")
        except socket.gaierror as exc:
            reasons.append(f"cannot resolve {host!r} ({exc.strerror})")
        except OSError:
            return None   # a timeout or an unreachable route: it may yet answer
    return "; ".join(sorted(set(reasons)))


#: What a request raises when ZooKeeper could not be reached or this client was
#: closed. RetryFailedError: kazoo's command retry ran past its deadline.
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    ZKConnectionError, ConnectionLoss, SessionExpiredError, KazooTimeoutError,
    ConnectionClosedError, OperationTimeoutError, RetryFailedError,
)


def log_failure(log: logging.Logger, exc: BaseException, message: str, *args: Any,
                level: int = logging.WARNING) -> None:
    """Log a failed background request: a lost or closed connection is expected
    (an outage, a session expiry, celery reconnecting) and gets a plain warning
    naming it; anything else is logged at ``level`` with its traceback."""
    if isinstance(exc, CONNECTION_ERRORS):
        log.warning(message + " (%s: %s)", *args, type(exc).__name__, exc)
    else:
        log.log(level, message, *args, exc_info=exc)


def unwaited(result: Any, log: logging.Logger, message: str, *args: Any,
             expected: tuple[type[Exception], ...] = (), level: int = logging.WARNING) -> None:
    """Send a request's reply nowhere: what ``expected`` names is an outcome,
    any other failure is logged (:func:`log_failure`) on kazoo's thread,
    which this never blocks."""
    def done(reply: Any) -> None:
        try:
            reply.get()
        except expected:
            pass
        except Exception as exc:
            log_failure(log, exc, message, *args, level=level)
    result.rawlink(done)


def multi_failure(results: list[Any]) -> tuple[int, Exception] | None:
    """Index and error of the op that made a multi transaction fail, or None.

    The ops before it report RolledBackError and those after it
    RuntimeInconsistency; neither says what went wrong.
    """
    for index, result in enumerate(results):
        if isinstance(result, Exception) and not isinstance(
                result, (RolledBackError, RuntimeInconsistency)):
            return index, result
    return None


T = TypeVar("T")
K = TypeVar("K")

#: What kazoo's command retry retries (KazooRetry's defaults, ignore_expire on).
_RETRIED = KazooRetry.RETRY_EXCEPTIONS + KazooRetry.EXPIRED_EXCEPTIONS


#: Seconds a write that nobody could redo (a task's result) keeps trying beyond the
#: command retry's deadline: long enough to ride out a leader failover. See
#: docs/backend.md, "Outages", and docs/design.md, "Time constants".
FAILOVER_PATIENCE = 30.0


def not_connected(client: KazooClient) -> ConnectionLoss | ConnectionClosedError:
    """What a request made while ``client`` is not connected raises:
    ConnectionLoss, which kazoo's retry repeats until it is connected again,
    or ConnectionClosedError once it was stopped (given up at a shutdown, see
    :func:`celery_zk.zk.background.give_up_when_cut_off`): no retry brings it back."""
    if client.client_state == KeeperState.CLOSED:
        return ConnectionClosedError("celery_zk: this ZooKeeper client was stopped")
    return ConnectionLoss("not connected to ZooKeeper")


def connected_retry(client: KazooClient, func: Callable[..., T], *args: Any,
                    patience: float = 0.0) -> T:
    """``client.retry(func, *args)``, where an attempt made while the connection
    is down fails (ConnectionLoss, retried) instead of waiting in kazoo's queue.

    kazoo queues a request made while it reconnects and sends it once it is
    connected again, however long that takes. That is right for an ack (it
    must land on the session that claimed the message), but a publish or a
    result write would hang for the whole outage: this way the caller gets a
    connection error once the command retry's deadline (``max(session_timeout,
    5)`` s) has passed, and Celery's own retry (or the caller) takes over.
    With ``patience`` the command retry starts again until that many more
    seconds have passed (see :data:`FAILOVER_PATIENCE`), and once more if
    the client is connected when it gives up.
    """
    def attempt(*inner: Any) -> T:
        if client.state != KazooState.CONNECTED:
            raise not_connected(client)
        return func(*inner)

    until = monotonic() + patience
    once_more = False
    while True:
        try:
            return client.retry(attempt, *args)
        except RetryFailedError:
            if client.client_state == KeeperState.CLOSED:
                raise
            # Connected again as the retry gave up (its last sleep ended too late):
            # one more round, which tries at once (the nemesis saw a result stored
            # as FAILURE 25 ms after the reconnect).
            if monotonic() >= until:
                if client.state != KazooState.CONNECTED or once_more:
                    raise
                once_more = True


def synced(client: KazooClient, path: str) -> None:
    """Make the server this client talks to catch up with the leader, before a
    read that decides whether a write whose reply was lost happened.

    A reconnect may land on a follower that is behind (cut off from the leader
    when the reply was lost, say): without this, it can answer that a node
    the write made does not exist, and the write is done a second time (seen
    by the nemesis: one apply_async stored twice). ZooKeeper's sync is made
    for exactly this.
    """
    client.retry(client.sync, path)


def children(client: KazooClient, path: str) -> list[str]:
    """``path``'s children (retried through a lost connection); none where
    ``path`` does not exist, as for a directory deleted or not made yet."""
    try:
        return client.retry(client.get_children, path)
    except NoNodeError:
        return []


def delete_if_there(client: KazooClient, path: str,
                    also: tuple[type[Exception], ...] = ()) -> None:
    """Delete ``path`` (retried through a lost connection); a node gone already
    is no error, nor what ``also`` names (NotEmptyError: a directory refilled)."""
    try:
        client.retry(client.delete, path)
    except (NoNodeError, *also):
        pass


def listings(client: KazooClient, paths: list[str]) -> list[tuple[str, list[str]]]:
    """``(path, its children)`` of every path, read in one pipelined round;
    missing ones left out, a lost reply read again (:func:`reply_or_retry`)."""
    replies = [(path, client.get_children_async(path)) for path in paths]
    found = []
    for path, reply in replies:
        try:
            found.append((path, reply_or_retry(client, reply, client.get_children, path)))
        except NoNodeError:
            pass   # a lost reply is read again: not answered()
    return found


def answered(replies: Iterable[tuple[K, Any]]) -> Iterator[tuple[K, Any]]:
    """``(key, value)`` of each pipelined ``(key, reply)`` in turn, those of
    nodes gone meanwhile (NoNodeError) left out."""
    for key, reply in replies:
        try:
            value = reply.get()
        except NoNodeError:
            continue
        yield key, value


def json_object(data: bytes | None) -> dict[str, Any]:
    """A node's data read as a JSON object; ``{}`` where it is empty or not one
    (damaged, or written by something else)."""
    try:
        value = json.loads(data or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def create_once(client: KazooClient, create: Callable[[], str],
                find: Callable[[], str | None], maybe_made: bool = False) -> str:
    """Run ``create`` (see :func:`connected_retry`), making one node at most.

    A create whose reply was lost (ConnectionLoss) may have happened; every
    retry first asks ``find`` for the node it would have made (recognised by
    a unique part of its name) and returns that instead of making a second.
    ``maybe_made``: an earlier attempt made elsewhere lost its reply, so look first.
    """
    if not maybe_made and client.state == KazooState.CONNECTED:
        try:
            return create()   # the common case, without the retry machinery's cost
        except _RETRIED:
            pass   # the reply was lost: the node may exist, so look before each retry

    def attempt() -> str:
        synced(client, "/")   # see synced: the look must see the lost write
        return find() or create()

    return connected_retry(client, attempt)


def reply_or_retry(client: KazooClient, result: Any, call: Callable[..., Any],
                   *args: Any) -> Any:
    """The reply of a pipelined read; if it was lost (ConnectionLoss), the read again.

    A read is safe to repeat, so one lost reply in a pipelined batch costs a
    retried request instead of failing the whole batch.
    """
    try:
        return result.get()
    except ConnectionLoss:
        return client.retry(call, *args)


class RedoThread(Generic[T]):
    """Requests to redo after a lost reply, done in order on one daemon thread.

    A completion callback runs on kazoo's thread, which must not block, so it
    only hands the work over. The thread is started when work arrives and
    ends when none is left. ``work`` handles (logs) its own failures.
    """

    def __init__(self, name: str, work: Callable[[T], None]) -> None:
        self._name = name
        self._work = work
        self._items: deque[T] = deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, item: T) -> None:
        with self._lock:
            self._items.append(item)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name,
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._items:
                    self._thread = None
                    return
                item = self._items.popleft()
            self._work(item)

    def join(self, timeout: float) -> bool:
        """Wait until the work submitted so far is done; False if ``timeout``
        seconds passed first (or when called from the thread itself)."""
        deadline = monotonic() + timeout
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                return True
            left = deadline - monotonic()
            if thread is threading.current_thread() or left <= 0:
                return False
            thread.join(left)


def _tls_hint(settings: ZKSettings) -> str:
    # A plaintext client on a TLS port (or the reverse) only ever sees dropped
    # connections, so the timeout is the one place to say what to check.
    if settings.options.use_ssl:
        return ("With use_ssl=true, check that the port is the server's secureClientPort "
                "and that 'ca', 'certfile' and 'keyfile' are the right files (the server "
                "log shows failed TLS handshakes).")
    return ("If the server only accepts TLS (a secureClientPort), add use_ssl=true and "
            "the 'ca', 'certfile' and 'keyfile' options.")


def check_root(client: KazooClient, settings: ZKSettings) -> None:
    """Make the settings' root path and check that we may use it (clear auth error)."""
    try:
        client.ensure_path(settings.root)
        client.get_children(settings.root)
    except NoAuthError:
        who = f"user {settings.username!r}" if settings.username else "an unauthenticated client"
        raise ZKAuthError(
            f"ZooKeeper refused {who} access to {settings.root!r} on {settings.hosts}: "
            "wrong password, or the node's ACL belongs to someone else. Check the "
            "credentials in the zk:// URL.") from None
