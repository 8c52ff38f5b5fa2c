"""kazoo's connection on a real ZooKeeper, through celery_zk's handler
(celery_zk.zk.handler): a busy client whose server goes silent moves on."""
from __future__ import annotations

import threading
from typing import Any

import pytest
from kazoo.protocol.states import KazooState

from celery_zk.zk.client import make_client
from celery_zk.zk.config import parse_url

#: The handler relies on how kazoo waits for its socket: every supported release runs this.
pytestmark = pytest.mark.matrix


def test_a_busy_client_cut_off_from_its_server_moves_on_and_keeps_its_session(
        zookeeper_server: Any, zk_chroot: str) -> None:
    """kazoo pings only after a quiet spell and takes every request it sends
    for one, so a client that keeps sending never noticed its server had gone
    silent: it wrote into the void until its session had expired (the
    nemesis: a worker whose server was partitioned away ran a task that was
    then requeued and run again). Now, as ZooKeeper's own client, it drops a
    connection that left a request unanswered for two thirds of the session
    timeout, and reconnects in time to keep its session."""
    from .tcpproxy import TCPProxy
    from .workers import wait_until

    host, port = zookeeper_server.hosts.rsplit(":", 1)
    with TCPProxy(host, int(port)) as proxy:
        client = make_client(parse_url(f"zk://{proxy.hosts}{zk_chroot}?session_timeout=6"))
        states: list[str] = []
        client.add_listener(states.append)
        session = client.client_id[0]
        stop = threading.Event()

        def busy() -> None:   # a worker's steady requests: acks, reads, dispatch
            while not stop.is_set():
                client.exists_async("/")
                stop.wait(0.05)
        thread = threading.Thread(target=busy, daemon=True)
        thread.start()
        try:
            stop.wait(0.5)
            proxy.cut()   # this server goes silent; a new connection gets through
            wait_until(lambda: KazooState.SUSPENDED in states, 30,
                       message="the client never noticed its server went silent")
            wait_until(lambda: client.state == KazooState.CONNECTED, 30,
                       message="the client never reconnected")
            assert KazooState.LOST not in states
            assert client.client_id[0] == session, "the session was lost"
            assert proxy.connections == 2
            assert client.exists("/") is not None
        finally:
            stop.set()
            thread.join(5)
            client.stop()
            client.close()
