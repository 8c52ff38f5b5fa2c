"""Which users of a process share a ZooKeeper session (celery_zk.zk.session)."""
from __future__ import annotations

from celery_zk.zk.config import parse_url
from celery_zk.zk.session import session_key, weak_callback


def key(url: str, **options: object) -> tuple[object, ...]:
    return session_key(parse_url(url, options))


def test_broker_and_backend_of_one_app_share_a_session() -> None:
    # The root and the connect timeout are per user: checked per lease, waited per call.
    assert key("zk://h1:2181/app") == key("zk://h1:2181/other", connect_timeout=3)
    assert key("zk://h1:2181/app") == key("zk://h1:2181/app", claim_batch=8, handoff=False)


def test_what_the_session_is_made_of_separates_sessions() -> None:
    base = key("zk://alice:pw@h1:2181/app")
    assert base != key("zk://alice:other@h1:2181/app")
    assert base != key("zk://bob:pw@h1:2181/app")
    assert base != key("zk://alice:pw@h1:2182/app")
    assert base != key("zk://alice:pw@h1:2181/app", session_timeout=30)
    assert base != key("zk://alice:pw@h1:2181/app", use_ssl=True)
    assert base != key("zk://alice:pw@h1:2181/app", session_name="apart")


def test_a_weak_callback_does_not_keep_its_object_alive() -> None:
    class Owner:
        def on(self, value: int) -> int:
            return value + 1

    owner = Owner()
    callback = weak_callback(owner.on, dead=False)
    assert callback(1) == 2
    del owner
    assert callback(1) is False
