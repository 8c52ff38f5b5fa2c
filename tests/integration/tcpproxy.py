"""A loopback TCP proxy that can black-hole its connections: a real partition.

``blackhole()`` stops forwarding *and stops reading* without closing
anything: both ends keep an open socket whose peer has gone silent, which is
what a pulled cable or a dropped route looks like (a close would instead be
noticed at once). New connections made meanwhile are accepted and held
silent too (as a SYN to a dropped route would be). ``heal()`` lets bytes
flow again on the same sockets, as a network that comes back does.
``cut()`` black-holes only the connections open now: a server cut off from
its clients while the way to another server is open (new connections here).

Threads only, one pair per connection plus the acceptor; ``stop()`` (or
leaving the ``with`` block) ends them all.
"""
from __future__ import annotations

import select
import socket
import threading
from typing import Any

_CHUNK = 65536
_TICK = 0.05  # how often idle threads look at the flags


class TCPProxy:
    """Forward ``127.0.0.1:<port>`` to ``target``; ``blackhole()``/``heal()`` it."""

    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1",
                 max_connections: int = 64) -> None:
        self.target = (target_host, target_port)
        self.max_connections = max_connections
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(_TICK)
        self.host, self.port = self._listener.getsockname()[:2]
        self._blackholed = threading.Event()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._cut: set[socket.socket] = set()   # black-holed alone (cut())
        self._threads: list[threading.Thread] = []
        self.connections = 0  # accepted so far: tests can see a client reconnect

    @property
    def hosts(self) -> str:
        return f"{self.host}:{self.port}"

    # -- control ------------------------------------------------------------------
    def start(self) -> TCPProxy:
        self._spawn(self._accept_loop, "tcpproxy-accept")
        return self

    def blackhole(self) -> None:
        """Stop moving bytes either way; keep every socket open."""
        self._blackholed.set()

    def cut(self) -> None:
        """Stop moving bytes on the connections open now; forward new ones."""
        with self._lock:
            self._cut.update(self._sockets)

    def heal(self) -> None:
        """Forward again, on the same sockets: whatever each end did meanwhile
        (a client that gave up closed its side) is what the other end now sees."""
        self._blackholed.clear()
        with self._lock:
            self._cut.clear()

    def stop(self) -> None:
        self._stopped.set()
        _close(self._listener)
        with self._lock:
            held, self._sockets = self._sockets, []
        for sock in held:
            _close(sock)
        for thread in self._threads:
            thread.join(5)

    def __enter__(self) -> TCPProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- threads ------------------------------------------------------------------
    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # listener closed by stop()
            self.connections += 1
            with self._lock:
                if len(self._sockets) >= 2 * self.max_connections:
                    _close(client)
                    continue
                self._sockets.append(client)
            self._spawn(self._connect_and_pipe, "tcpproxy-conn", client)

    def _connect_and_pipe(self, client: socket.socket) -> None:
        # A connection accepted during a partition hangs until heal() or stop().
        while self._blackholed.is_set() and not self._stopped.is_set():
            if client.fileno() < 0:
                return
            self._stopped.wait(_TICK)
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            _close(client)
            return
        with self._lock:
            self._sockets.append(upstream)
        self._pipe(client, upstream)

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while not self._stopped.is_set():
                if self._blackholed.is_set() or a in self._cut:
                    if a.fileno() < 0 or b.fileno() < 0:
                        return  # heal() or stop() closed them
                    self._stopped.wait(_TICK)  # hold: read nothing, send nothing
                    continue
                readable, _, _ = select.select([a, b], [], [], _TICK)
                for sock in readable:
                    if self._blackholed.is_set() or a in self._cut:
                        break
                    data = sock.recv(_CHUNK)
                    if not data:
                        return
                    peers[sock].sendall(data)
        except (OSError, ValueError):
            return  # a side closed (ValueError: select on a closed socket)
        finally:
            _close(a)
            _close(b)
            with self._lock:
                self._sockets = [s for s in self._sockets if s is not a and s is not b]
                self._cut.discard(a)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
