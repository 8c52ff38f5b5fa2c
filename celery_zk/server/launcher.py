"""Run a local Apache ZooKeeper server for development and tests.

It uses an installed ZooKeeper and Java runtime (:mod:`celery_zk.server.install`)
and never downloads anything. Each server runs ``QuorumPeerMain`` in its own
process group, logs to a file, and is ready once it serves clients (``srvr``
reports a mode; a quorum member, once it answers ``ruok``).
:class:`celery_zk.server.ensemble.ZooKeeperEnsemble` builds a quorum out of
these. See ``docs/launcher.md``, "Python API".
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any, Callable, NamedTuple, TypeVar

from ..exceptions import PortInUse, ServerStartError
from .install import JVM_FLAGS, ZooKeeperInstall, find_zookeeper

__all__ = ["Peer", "TLSConfig", "ZooKeeperServer", "four_letter_word", "free_ports",
           "render_config"]

logger = logging.getLogger(__name__)

STOP_GRACE = 10.0


@dataclass(frozen=True)
class TLSConfig:
    """Key material for ZooKeeper's TLS client port (JKS or PKCS12 stores)."""

    keystore: str
    keystore_password: str
    truststore: str
    truststore_password: str
    #: "need", "want" or "none": whether clients must present a certificate.
    client_auth: str = "need"
    #: "JKS" or "PKCS12"; None lets ZooKeeper guess from the file extension.
    store_type: str | None = None

    def config(self) -> dict[str, str]:
        if self.client_auth not in ("need", "want", "none"):
            raise ValueError(f"TLSConfig.client_auth must be 'need', 'want' or 'none', "
                             f"not {self.client_auth!r}")
        conf = {
            "ssl.keyStore.location": self.keystore,
            "ssl.keyStore.password": self.keystore_password,
            "ssl.trustStore.location": self.truststore,
            "ssl.trustStore.password": self.truststore_password,
            "ssl.clientAuth": self.client_auth,
        }
        if self.store_type:
            conf["ssl.keyStore.type"] = conf["ssl.trustStore.type"] = self.store_type
        return conf


class Peer(NamedTuple):
    """One ``server.N=host:quorum:election`` line of an ensemble."""

    server_id: int
    host: str
    quorum_port: int
    election_port: int


def render_config(*, data_dir: str, host: str, port: int | None, tick_time: int = 2000,
                  secure_port: int | None = None, tls: TLSConfig | None = None,
                  peers: Sequence[Peer] = (),
                  extra_config: dict[str, str] | None = None) -> str:
    """The zoo.cfg text. Unknown keys (ssl.*, serverCnxnFactory) become
    ``zookeeper.*`` system properties inside ZooKeeper, so zoo.cfg is enough."""
    conf: dict[str, str] = {"tickTime": str(tick_time), "dataDir": data_dir}
    if port is not None:
        conf["clientPort"] = str(port)
        conf["clientPortAddress"] = host
    if secure_port is not None:
        if tls is None:
            raise ValueError("secure_port needs a TLSConfig (tls=...) with the key material")
        conf["secureClientPort"] = str(secure_port)
        conf["secureClientPortAddress"] = host
        conf["serverCnxnFactory"] = "org.apache.zookeeper.server.NettyServerCnxnFactory"
        conf.update(tls.config())
    # Only what a launched server needs for its own probes and for operators'
    # read-only commands (cons counts connections, wchs watches). maxClientCnxns
    # keeps ZooKeeper's default (60 per client IP): a test suite must run into
    # the limit users have, not a lifted one.
    conf.update({
        "4lw.commands.whitelist": "ruok,srvr,mntr,stat,cons,wchs",
        "admin.enableServer": "false",
    })
    if peers:
        conf.update({"initLimit": "10", "syncLimit": "5"})
        for peer in peers:
            conf[f"server.{peer.server_id}"] = (
                f"{peer.host}:{peer.quorum_port}:{peer.election_port}")
    conf.update(extra_config or {})
    return "".join(f"{key}={value}\n" for key, value in conf.items())


def free_ports(count: int = 1, host: str = "127.0.0.1") -> list[int]:
    """Distinct free ports (all sockets held open until every port is picked)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Java sets SO_REUSEADDR too: only a listener, not TIME_WAIT, blocks it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PortInUse(
                f"Port {port} on {host} is already in use ({exc.strerror}). Choose another "
                f"port (e.g. --port {port + 1}) or stop the process listening on {port}."
            ) from exc


def four_letter_word(host: str, port: int, command: str, timeout: float = 2.0) -> str:
    """Send a 4lw command (ruok, srvr, ...) and return the reply; OSError if unreachable."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(command.encode("ascii"))
        chunks: list[bytes] = []
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return b"".join(chunks).decode("utf-8", "replace")
            chunks.append(chunk)


def _terminate(proc: subprocess.Popen[bytes], grace: float = STOP_GRACE) -> None:
    """SIGTERM the process group, SIGKILL it if it outlives the grace period."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            logger.warning("ZooKeeper pid %s ignored SIGTERM for %.0fs; killing it",
                           proc.pid, grace)
    # The JVM may be gone while a child it forked lingers: always sweep the group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


_L = TypeVar("_L", bound="Launched")


class Launched:
    """What a server and an ensemble share: an optional temporary directory
    (removed by ``close()`` or at interpreter exit) and ``with`` support."""

    _cleanup: weakref.finalize | None = None

    def _make_temp_dir(self, prefix: str) -> str:
        tmp = tempfile.mkdtemp(prefix=prefix)
        self._cleanup = weakref.finalize(self, shutil.rmtree, tmp, True)  # also atexit
        return tmp

    @property
    def running(self) -> bool:
        raise NotImplementedError

    def start(self: _L, timeout: float = 30) -> _L:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop, and remove the data dir if it was a temporary one."""
        self.stop()
        if self._cleanup is not None:
            self._cleanup()

    def __enter__(self: _L) -> _L:
        if not self.running:
            try:
                self.start()
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class ZooKeeperServer(Launched):
    """One local ZooKeeper process; ``with ZooKeeperServer() as zk: zk.url``.

    ``stop()`` ends the process but keeps the data, so ``start()``/``restart()``
    resume on it; ``close()`` (or leaving the ``with`` block) also removes a
    temporary data dir. Interpreter exit stops servers still running.
    """

    def __init__(self, port: int | None = None, data_dir: str | None = None,
                 host: str = "127.0.0.1", tick_time: int = 2000,
                 secure_port: int | None = None, tls: TLSConfig | None = None,
                 extra_config: dict[str, str] | None = None, *,
                 plaintext: bool = True, server_id: int | None = None,
                 peers: Sequence[Peer] = (), log_path: str | None = None,
                 install: ZooKeeperInstall | None = None,
                 jvm_flags: Sequence[str] = JVM_FLAGS,
                 command_prefix: Sequence[str] = ()) -> None:
        if not plaintext and (secure_port is None or tls is None):
            raise ValueError("plaintext=False (TLS only) needs secure_port and tls")
        self.host = host
        self.tick_time = tick_time
        self.port: int | None = (port or free_ports(1, host)[0]) if plaintext else None
        self.secure_port = secure_port
        self.tls = tls
        self.extra_config = dict(extra_config or {})
        self.server_id = server_id
        self.peers = tuple(peers)
        self._install = install
        self.jvm_flags = tuple(jvm_flags)
        #: Run java through this, e.g. ``("ip", "netns", "exec", "ns1")``: the
        #: server then binds an address of that network namespace. The prefix
        #: must exec java (the pid is java's, so kill() and SIGSTOP reach it).
        self.command_prefix = tuple(command_prefix)
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopper: weakref.finalize | None = None
        self._log_file: IO[bytes] | None = None
        if data_dir is None:
            tmp_dir = self._make_temp_dir("celery-zk-")
            self.data_dir = os.path.join(tmp_dir, "data")
            default_log = os.path.join(tmp_dir, "zookeeper.log")
        else:
            self.data_dir = os.path.abspath(data_dir)
            default_log = self.data_dir.rstrip(os.sep) + ".log"
        self.log_path = log_path or default_log

    # -- addresses ------------------------------------------------------------
    @property
    def client_port(self) -> int:
        """The port clients use: plaintext if there is one, else the TLS port."""
        port = self.port if self.port is not None else self.secure_port
        assert port is not None
        return port

    @property
    def hosts(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        return f"zk://{self.hosts}"

    @property
    def config_path(self) -> str:
        return os.path.join(self.data_dir, "zoo.cfg")

    def render_config(self) -> str:
        return render_config(data_dir=self.data_dir, host=self.host, port=self.port,
                             tick_time=self.tick_time, secure_port=self.secure_port,
                             tls=self.tls, peers=self.peers, extra_config=self.extra_config)

    # -- state ----------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def ruok(self) -> bool:
        """The process answers (``ruok`` → ``imok``); it may not serve clients yet."""
        return self._probe("ruok", lambda reply: reply == "imok")

    def serving(self) -> bool:
        """Clients can use it: ``ruok`` is answered before the database is loaded,
        and connections made in that gap are dropped, so ``srvr`` must show a mode."""
        return self._probe("srvr", lambda reply: "Mode: " in reply)

    def _probe(self, command: str, check: Callable[[str], bool]) -> bool:
        try:
            if self.port is None:  # TLS only: a 4lw would need a TLS handshake
                socket.create_connection((self.host, self.client_port), timeout=1).close()
                return True
            return check(four_letter_word(self.host, self.port, command, timeout=1))
        except OSError:
            return False

    def read_log(self, last_lines: int | None = None) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                if last_lines is None:
                    return fh.read()
                return "".join(deque(fh, maxlen=last_lines))
        except FileNotFoundError:
            return ""

    # -- lifecycle ------------------------------------------------------------
    def spawn(self) -> None:
        """Start the java process without waiting for it to be ready."""
        if self.running:
            return
        install = self._install or find_zookeeper()
        # Checked here only for our own namespace: another namespace's address
        # cannot be bound from here, and a busy port there shows in the log.
        for port in (self.port, self.secure_port):
            if port is not None and not self.command_prefix:
                _check_port_free(self.host, port)
        os.makedirs(self.data_dir, exist_ok=True)
        with open(self.config_path, "w", encoding="utf-8") as fh:
            fh.write(self.render_config())
        if self.server_id is not None:
            with open(os.path.join(self.data_dir, "myid"), "w", encoding="ascii") as fh:
                fh.write(f"{self.server_id}\n")
        self._log_file = open(self.log_path, "ab")  # append: restarts keep history
        cmd = [*self.command_prefix, *install.command(self.config_path, self.jvm_flags)]
        logger.debug("Starting ZooKeeper: %s", " ".join(cmd))
        # Own session: a Ctrl-C meant for us must not reach java before we stop it.
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log_file,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        self._stopper = weakref.finalize(self, _terminate, self._proc)

    def wait_ready(self, timeout: float = 30, serving: bool = True) -> None:
        """Wait until it serves clients (or, with ``serving=False``, just answers:
        an ensemble member cannot serve before a quorum forms)."""
        ready = self.serving if serving else self.ruok
        deadline = time.monotonic() + timeout
        while not ready():
            if not self.running:
                code = self._proc.returncode if self._proc else None
                self.stop()
                raise ServerStartError(self._failure(f"exited with code {code}"))
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(self._failure(f"was not ready within {timeout}s"))
            time.sleep(0.1)
        logger.info("ZooKeeper ready at %s (pid %s)", self.hosts, self.pid)

    def _failure(self, what: str) -> str:
        return (f"ZooKeeper on {self.hosts} {what}. Last lines of {self.log_path}:\n"
                f"{self.read_log(last_lines=40)}")

    def start(self, timeout: float = 30) -> ZooKeeperServer:
        self.spawn()
        self.wait_ready(timeout, serving=not self.peers)
        return self

    def stop(self) -> None:
        """Stop the process (no java left behind); the data dir stays."""
        if self._stopper is not None:
            self._stopper()  # runs _terminate once, then detaches from atexit
            self._stopper = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def kill(self) -> None:
        """SIGKILL at once, as a crash would (no clean shutdown); the data dir stays,
        so ``start()`` recovers from its log and snapshots."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.stop()   # reaps it, closes the log

    def restart(self, timeout: float = 30) -> ZooKeeperServer:
        self.stop()
        return self.start(timeout)

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"<ZooKeeperServer {self.hosts} {state} data={self.data_dir}>"
