from __future__ import annotations

import pytest

from celery_zk.exceptions import ZKConfigurationError
from celery_zk.zk.config import mask_password, parse_url


def test_full_url() -> None:
    s = parse_url("zk://alice:s3cret@h1:2181,h2,[::1]:2183/myapp?session_timeout=5&claim_batch=8")
    assert s.hosts == "h1:2181,h2:2181,[::1]:2183"
    assert s.root == "/myapp"
    assert (s.username, s.password) == ("alice", "s3cret")
    assert s.options.session_timeout == 5.0 and s.options.claim_batch == 8
    assert "s3cret" not in repr(s) and "s3cret" not in s.sanitized_url()


def test_defaults() -> None:
    s = parse_url("zk://")
    assert (s.hosts, s.root, s.username) == ("localhost:2181", "/celery", None)


def test_kombu_failover_form_is_one_host_list() -> None:
    s = parse_url(["zk://h1:2181", "zk://h2:2182/app"])
    assert s.hosts == "h1:2181,h2:2182" and s.root == "/app"
    assert parse_url("zk://h1;zk://h2/app").hosts == "h1:2181,h2:2181"


def test_url_wins_over_transport_options() -> None:
    s = parse_url("zk://h/?session_timeout=3", {"session_timeout": 7, "connect_timeout": 2})
    assert s.options.session_timeout == 3.0 and s.options.connect_timeout == 2.0


def test_generic_kombu_options_are_accepted() -> None:
    parse_url("zk://h/", {"polling_interval": 1, "max_retries": 3})
    # A publish's retry_policy lands in the transport options (kombu's Producer.publish).
    parse_url("zk://h/", {"errback": print, "on_revive": print, "retry_errors": (OSError,),
                          "connect_retries_timeout": 5})


@pytest.mark.parametrize("url, fragment", [
    ("zk://h/?sesion_timeout=3",
     "Unknown celery_zk option 'sesion_timeout'. Did you mean 'session_timeout'?"),
    ("zk://h/?visibilty_timeout=3", "Did you mean 'visibility_timeout'?"),
    ("zk://h/?session_timeout=abc", "must be a number"),
    ("zk://h/?session_timeout=-1", "must not be negative"),
    ("zk://h/?locality_wait=inf", "must be a finite number"),
    ("zk://h/?locality_wait=nan", "must be a finite number"),
    ("zk://h/?use_ssl=maybe", "true or false"),
    ("zk://h1,,h2/", "Empty host"),
    ("zk://h:99999/", "out of range"),
    ("zk://h:port/", "Malformed host"),
    ("zk://bob@h/", "user:password"),
    ("redis://h/", "not celery_zk's"),
    ("h1:2181", "Not a zk:// URL"),
    ("zk://h/?a=1&a=2", "given twice"),
    ("zk://h1/a;zk://h2/b", "same path"),
])
def test_bad_urls_say_what_is_wrong(url: str, fragment: str) -> None:
    with pytest.raises(ZKConfigurationError, match=fragment.replace("(", r"\(")):
        parse_url(url)


def test_errors_never_show_passwords() -> None:
    with pytest.raises(ZKConfigurationError) as info:
        parse_url("zk://bob:hunter2@h1,,h2/")
    assert "hunter2" not in str(info.value)


def test_mask_password() -> None:
    assert mask_password("zk://u:p@h:1/x") == "zk://u:**@h:1/x"
    assert mask_password("zk://h:1/x") == "zk://h:1/x"


def test_hidden_secrets_come_back_only_in_this_process() -> None:
    from celery_zk.zk.config import hide_secrets, reveal_secrets

    url = "zk://alice:pw@h1:2181/app?read_only_users=bob:pw2&keyfile_password=k"
    masked = hide_secrets(url, "pw")
    assert masked == "zk://alice:**@h1:2181/app?read_only_users=bob:**&keyfile_password=**"
    assert reveal_secrets(masked, "pw") == url
    assert reveal_secrets(masked, "other") == masked   # the password is part of the key
    assert reveal_secrets("zk://h1:2181/app", None) == "zk://h1:2181/app"


def test_celery_reports_mask_zk_query_secrets_and_leave_other_urls_alone() -> None:
    from celery.app import utils

    from celery_zk.zk.config import mask_in_celery_reports

    mask_in_celery_reports()
    mask_in_celery_reports()   # idempotent
    # What `celery report` and app.conf.humanize() show, on every Celery release.
    shown = utils.filter_hidden_settings({
        "result_backend": "zk://alice:pw@h/app?read_only_users=bob:secret",
        # amqp: kombu's own dependency, installed with every release (older kombu
        # loads the URL's transport to mask it, and redis-py may be missing).
        "broker_url": "amqp://guest:pw@localhost:5672//"})
    assert "secret" not in shown["result_backend"] and "pw" not in shown["result_backend"]
    assert shown["broker_url"].startswith("amqp://guest:********@localhost")


@pytest.mark.parametrize("size", ["1", "10001", "0"])
def test_bucket_size_out_of_range_says_why(size: str) -> None:
    with pytest.raises(ZKConfigurationError, match="bucket_size.*between 2 and 10,000.*1 MiB"):
        parse_url(f"zk://h/app?bucket_size={size}")
    assert parse_url("zk://h/app?bucket_size=2").options.bucket_size == 2


@pytest.mark.parametrize("value", ["0", "17"])
def test_lookahead_out_of_range_says_what_it_is(value: str) -> None:
    with pytest.raises(ZKConfigurationError, match="'lookahead' must be between 1 and 16"):
        parse_url(f"zk://h1/app?lookahead={value}")


def test_lookahead_1_turns_it_off() -> None:
    assert parse_url("zk://h1/app?lookahead=1").options.lookahead == 1
    assert parse_url("zk://h1/app").options.lookahead == 16


def test_options_of_other_brokers_are_ignored_with_one_warning_each(
        caplog: pytest.LogCaptureFixture) -> None:
    """A Redis user's broker_transport_options start a worker: each option that
    means nothing for ZooKeeper is named once, with why; nothing else changes."""
    from celery_zk.zk import config

    redis_user = {"visibility_timeout": 43200, "priority_steps": [0, 3, 6, 9],
                  "sep": ":", "queue_order_strategy": "priority", "socket_timeout": 5,
                  "socket_keepalive": True, "max_connections": 20, "master_name": "m"}
    config._warned.difference_update(redis_user)
    with caplog.at_level("WARNING", logger="celery_zk"):
        settings = parse_url("zk://h/", redis_user)
        parse_url("zk://h/", redis_user)   # a second URL: no second warning
    assert settings.options == parse_url("zk://h/").options
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == len(redis_user), warnings
    said = dict(zip(redis_user, warnings))
    assert "has no visibility timeout" in said["visibility_timeout"]
    assert "9 first" in said["priority_steps"] and "Redis serves 0 first" in said[
        "priority_steps"]
    assert "session_timeout" in said["socket_timeout"]
    assert all("is ignored" in w and "Remove it" in w for w in warnings)
