"""The ``zk://`` URL grammar and every option the broker and backend take.

Broker and result backend share this one parser, so a URL that works for one
works for the other; kombu's ``;``-separated failover form is folded into one
host list. Options come from the URL query and the ``*_transport_options``
(the URL wins), and an unknown option is an error, never a silent no-op. See
``docs/configuration.md``, "URL grammar" and "Options".
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ..exceptions import ZKConfigurationError
from .names import MAX_CHUNKS

logger = logging.getLogger(__name__)

SCHEMES = ("zk", "zookeeper")
DEFAULT_PORT = 2181
DEFAULT_ROOT = "/celery"
MIN_BUCKET_SIZE = 2
MAX_BUCKET_SIZE = 10_000   # 10,000 names of ~45 bytes: a 450 KB listing
MAX_LOOKAHEAD = 16         # times the prefetch: a -c 4 worker (prefetch 16) holds 256
#: Chunks of a payload (celery_zk.zk.payload) are at least this big (smaller is
#: all overhead) and at most this big: a create request carries the chunk, its
#: path and an ACL, and must stay below the server's jute.maxbuffer (1 MiB).
MIN_CHUNK_SIZE = 1024
MAX_CHUNK_SIZE = 1_000_000

# kombu/celery option names that are meaningful for every virtual transport;
# accepted (and ignored where they do not apply) so shared settings keep working.
# kombu's Producer.publish copies a publish's retry_policy (Connection.ensure's
# keywords: errback, on_revive, retry_errors too) into the transport options.
GENERIC_KOMBU_OPTIONS = frozenset({
    "body_encoding", "deadletter_queue", "polling_interval", "max_retries",
    "interval_start", "interval_step", "interval_max", "errback", "on_revive",
    "retry_errors", "connect_retries_timeout",
    "global_keyprefix", "fanout_prefix", "fanout_patterns",
})

_REDIS_ACKS = ("Redis's emulation of acks; an ack here is a ZooKeeper transaction, and "
               "an unacknowledged message goes back when its owner's session ends")
_REDIS_SOCKET = ("a Redis client's connection setting; a ZooKeeper session has its own "
                 "('connect_timeout', 'session_timeout')")

#: Options of other brokers' transports (Redis, Redis Sentinel, RabbitMQ) and
#: of earlier releases that mean nothing here: accepted with one warning that
#: says why, so settings brought from another broker, or a URL of an earlier
#: release, keep working.
_IGNORED_OPTIONS = {
    "visibility_timeout": (
        "celery_zk has no visibility timeout: a claimed message goes back to its queue "
        "only when its owner's ZooKeeper session ends (tune 'session_timeout')"),
    "priority_steps": ("every queue has priorities 0-9 in its message names, 9 first (as "
                       "RabbitMQ; Redis serves 0 first)"),
    "sep": "Redis's key separator; celery_zk escapes names itself",
    "queue_order_strategy": (
        "a worker consuming several queues is given messages of each by its dispatcher, "
        "not by polling them in turn"),
    **dict.fromkeys(("ack_emulation", "unacked_key", "unacked_index_key", "unacked_mutex_key",
                     "unacked_mutex_expire", "unacked_restore_limit",
                     "unacked_restore_interval", "unacked_restore_throttle"), _REDIS_ACKS),
    **dict.fromkeys(("socket_timeout", "socket_connect_timeout", "socket_keepalive",
                     "socket_keepalive_options", "retry_on_timeout", "health_check_interval",
                     "max_connections", "client_name", "client_properties", "read_timeout",
                     "write_timeout"), _REDIS_SOCKET),
    **dict.fromkeys(("master_name", "min_other_sentinels", "sentinel_kwargs",
                     "sentinel_fanout_compat"),
                    "Redis Sentinel's; name every ZooKeeper server in the URL instead"),
    "listing_max_age": "consumers have not listed queues since celery_zk 0.2",
    "persistent_watches": ("celery_zk 0.4 needs ZooKeeper 3.6 or newer and always "
                           "waits on persistent watches"),
}

_HOST_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+)(?::(\d{1,5}))?$")


@dataclass(frozen=True)
class ZKOptions:
    """Transport and backend options. What each does, its range and its
    default are in ``docs/configuration.md`` (every field has its row there,
    and its line in :mod:`celery_zk.broker.transport`'s docstring: tested)."""

    session_timeout: float = 10.0
    connect_timeout: float = 10.0
    claim_batch: int = 64
    lookahead: int = 16           # 1 to MAX_LOOKAHEAD
    bucket_size: int = 4096       # MIN_BUCKET_SIZE to MAX_BUCKET_SIZE
    handoff: bool = True
    locality_wait: float = 3.0
    dead_letter_rejected: bool = False
    confirm_publish: bool = True
    batch_groups: bool = True
    max_message_size: int = 16_777_216   # RabbitMQ 4's default
    chunk_size: int = 131_072     # MIN_CHUNK_SIZE to MAX_CHUNK_SIZE
    max_result_size: int = 16_777_216
    expire_every: float = 600.0   # rounds: expired results, unused queues (0: none)
    budget_nodes: int = 400_000   # znodes under the root; 0: no limit (docs/sizing.md)
    budget_bytes: int = 134_217_728   # bytes of data under the root; 0: no limit
    budget_wait: float = 60.0     # s a publish waits over the budget, then StorageFull
    acl: str = "auto"             # or "open"
    read_only_users: str = ""     # user:password,...
    use_ssl: bool = False
    ca: str = ""
    certfile: str = ""
    keyfile: str = ""
    keyfile_password: str = ""
    verify_certs: bool = True
    session_name: str = ""


@dataclass(frozen=True)
class ZKSettings:
    """Everything needed to connect: hosts, root path, credentials, options."""

    hosts: str
    root: str = DEFAULT_ROOT
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    options: ZKOptions = field(default_factory=ZKOptions)
    #: Options the user set (URL or transport options), as opposed to defaults.
    given: frozenset[str] = field(default=frozenset(), compare=False)

    def sanitized_url(self) -> str:
        """The URL with the password masked, for logs and reprs."""
        auth = f"{self.username}:**@" if self.username else ""
        return f"zk://{auth}{self.hosts}{self.root}"


def _coerce(name: str, raw: Any, typ: Any) -> Any:
    kind = typ if isinstance(typ, str) else typ.__name__
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ZKConfigurationError(
            f"celery_zk option {name!r} must be true or false, not {raw!r}.")
    if kind in ("int", "float"):
        try:
            value = (int if kind == "int" else float)(raw)
        except (TypeError, ValueError):
            raise ZKConfigurationError(
                f"celery_zk option {name!r} must be a number, not {raw!r}.") from None
        if not math.isfinite(value):   # nan compares false with everything, inf never ends
            raise ZKConfigurationError(
                f"celery_zk option {name!r} must be a finite number, not {raw!r}.")
        if value < 0:
            raise ZKConfigurationError(
                f"celery_zk option {name!r} must not be negative (got {raw!r}).")
        return value
    return str(raw)


def build_options(*sources: Mapping[str, Any] | None) -> ZKOptions:
    """Merge option mappings (later ones win) into a validated :class:`ZKOptions`."""
    known = {f.name: f for f in dataclasses.fields(ZKOptions)}
    values: dict[str, Any] = {}
    for source in sources:
        for name, raw in (source or {}).items():
            if name in GENERIC_KOMBU_OPTIONS:
                continue
            if name in _IGNORED_OPTIONS:
                _warn_ignored(name)
                continue
            if name not in known:
                close = difflib.get_close_matches(name, [*known, *_IGNORED_OPTIONS], 1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ZKConfigurationError(
                    f"Unknown celery_zk option {name!r}.{hint} Valid options: "
                    f"{', '.join(sorted(known))} (docs/configuration.md).")
            values[name] = _coerce(name, raw, known[name].type)
    bucket_size = values.get("bucket_size", ZKOptions.bucket_size)
    if not MIN_BUCKET_SIZE <= bucket_size <= MAX_BUCKET_SIZE:
        raise ZKConfigurationError(
            f"celery_zk option 'bucket_size' must be between {MIN_BUCKET_SIZE} and "
            f"{MAX_BUCKET_SIZE:,} (got {bucket_size}): a bucket is listed whole, and "
            "a listing must stay far below the 1 MiB a ZooKeeper reply may carry.")
    lookahead = values.get("lookahead", ZKOptions.lookahead)
    if not 1 <= lookahead <= MAX_LOOKAHEAD:
        raise ZKConfigurationError(
            f"celery_zk option 'lookahead' must be between 1 and {MAX_LOOKAHEAD} (got "
            f"{lookahead}): how many times its prefetch a fast consumer's inbox may "
            "hold; 1 turns the lookahead off.")
    _check_payload_options(values.get("chunk_size", ZKOptions.chunk_size),
                           values.get("max_result_size", ZKOptions.max_result_size))
    _check_payload_options(values.get("chunk_size", ZKOptions.chunk_size),
                           values.get("max_message_size", ZKOptions.max_message_size),
                           "max_message_size")
    return ZKOptions(**values)


_warned: set[str] = set()


def _warn_ignored(name: str) -> None:
    if name not in _warned:   # once per process, however many URLs name it
        _warned.add(name)
        logger.warning("celery_zk: option %r is ignored: %s. Remove it from the URL or "
                       "the transport options.", name, _IGNORED_OPTIONS[name])


def _check_payload_options(chunk_size: int, largest: int,
                           option: str = "max_result_size") -> None:
    """``chunk_size`` and the largest payload ``option`` allows fit together."""
    what = "result" if option == "max_result_size" else "message"
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise ZKConfigurationError(
            f"celery_zk option 'chunk_size' must be between {MIN_CHUNK_SIZE:,} and "
            f"{MAX_CHUNK_SIZE:,} bytes (got {chunk_size:,}): each chunk is one request, "
            "which must stay below the server's jute.maxbuffer (1 MiB).")
    if largest < 1:
        raise ZKConfigurationError(
            f"celery_zk option '{option}' must be at least 1 byte (got {largest}); it is "
            f"the largest {what} stored, default 16 MiB.")
    if -(-largest // chunk_size) > MAX_CHUNKS:
        raise ZKConfigurationError(
            f"celery_zk options: a {what} of {option} ({largest:,} bytes) would take "
            f"more than {MAX_CHUNKS:,} chunks of chunk_size ({chunk_size:,}); raise "
            f"chunk_size or lower {option}.")


def _parse_hosts(netloc_hosts: str, url: str) -> list[str]:
    hosts = []
    for part in netloc_hosts.split(","):
        part = part.strip()
        if not part:
            raise ZKConfigurationError(
                f"Empty host in {mask_password(url)!r}: separate hosts with single commas, "
                "e.g. zk://h1:2181,h2:2181/app.")
        match = _HOST_RE.match(part)
        if not match:
            raise ZKConfigurationError(
                f"Malformed host {part!r} in {mask_password(url)!r}: expected host or "
                "host:port.")
        host, port = match.group(1), match.group(2)
        port_no = int(port) if port else DEFAULT_PORT
        if not 0 < port_no < 65536:
            raise ZKConfigurationError(
                f"Port {port_no} of host {host!r} is out of range (1-65535).")
        hosts.append(f"{host}:{port_no}")
    return hosts


def _split_url(url: str) -> tuple[str | None, str | None, list[str], str, dict[str, str]]:
    if "://" not in url:
        raise ZKConfigurationError(
            f"Not a zk:// URL: {mask_password(url)!r}. Use "
            "zk://[user:password@]host[:port][,host[:port]...][/path][?option=value].")
    scheme, rest = url.split("://", 1)
    if scheme not in SCHEMES:
        raise ZKConfigurationError(
            f"URL scheme {scheme!r} is not celery_zk's; use zk://.")
    # urlsplit cannot take comma-separated host:port lists, so split by hand.
    netloc, sep, tail = rest.partition("/")
    if "?" in netloc:  # zk://host?opt=1 without a path
        netloc, _, query_only = netloc.partition("?")
        tail, sep = "?" + query_only, "/"
    path_part = urlsplit("zk://x/" + tail if sep else "zk://x")
    userinfo, _, hostpart = netloc.rpartition("@")
    user = password = None
    if userinfo:
        user_raw, colon, pw_raw = userinfo.partition(":")
        user = unquote(user_raw) or None
        password = unquote(pw_raw) if colon else None
        if user is None or password is None:
            raise ZKConfigurationError(
                "Credentials in a zk:// URL must be user:password@ (digest auth); "
                f"got {mask_password(url)!r}.")
    hosts = _parse_hosts(hostpart, url) if hostpart else [f"localhost:{DEFAULT_PORT}"]
    query: dict[str, str] = {}
    for key, value in parse_qsl(path_part.query, keep_blank_values=True, strict_parsing=False):
        if key in query:
            raise ZKConfigurationError(f"Option {key!r} is given twice in the URL.")
        query[key] = value
    return user, password, hosts, unquote(path_part.path), query


def normalize_root(path: str) -> str:
    root = "/" + path.strip("/") if path and path.strip("/") else DEFAULT_ROOT
    for part in root.split("/")[1:]:
        if part in (".", "..") or part.startswith("zookeeper") and root == "/" + part:
            raise ZKConfigurationError(
                f"Path {root!r} cannot be used as celery_zk's root; pick another, "
                "e.g. /myapp.")
    return root


def parse_url(
    url: str | Iterable[str], transport_options: Mapping[str, Any] | None = None,
) -> ZKSettings:
    """Parse one URL, or kombu's list of failover alternates, into settings."""
    urls = [url] if isinstance(url, str) else list(url)
    urls = [u for chunk in urls for u in chunk.split(";") if u.strip()]
    if not urls:
        raise ZKConfigurationError("No zk:// URL given.")
    all_hosts: list[str] = []
    user = password = None
    path = ""
    query: dict[str, str] = {}
    for one in urls:
        u_user, u_password, hosts, u_path, u_query = _split_url(one.strip())
        for host in hosts:
            if host not in all_hosts:
                all_hosts.append(host)
        # Alternates may omit path/credentials/options; where given, they must agree.
        if (u_path and path and u_path != path) or (u_user and user and u_user != user):
            raise ZKConfigurationError(
                "Failover URLs must share the same path and credentials; only their "
                f"hosts may differ ({mask_password(urls[0])!r} vs {mask_password(one)!r}).")
        path = path or u_path
        if u_user and not user:
            user, password = u_user, u_password
        query = {**u_query, **query}
    return ZKSettings(
        hosts=",".join(all_hosts),
        root=normalize_root(path),
        username=user,
        password=password,
        options=build_options(transport_options, query),
        given=frozenset(query) | frozenset(transport_options or ()),
    )


#: What a password becomes in a masked URL.
MASK = "**"
_PASSWORD_RE = re.compile(r"(://[^:/@]*:)[^@/]*@")
# Options whose values hold passwords: read_only_users=user:pw,... and keyfile_password.
_SECRET_OPTION_RE = re.compile(r"([?&](read_only_users|keyfile_password)=)([^&;]*)")


def _mask_option(match: re.Match[str]) -> str:
    prefix, name, value = match.groups()
    if name == "keyfile_password":
        return f"{prefix}**" if value else prefix
    users = (unquote(pair).partition(":")[0] for pair in unquote(value).split(","))
    return prefix + ",".join(f"{user}:**" for user in users if user)


def mask_password(url: str) -> str:
    """``zk://u:secret@h`` -> ``zk://u:**@h``; used for every URL that reaches a log.

    Passwords in options (``read_only_users``, ``keyfile_password``) are masked too.
    """
    return _SECRET_OPTION_RE.sub(_mask_option, _PASSWORD_RE.sub(rf"\1{MASK}@", url))


def mask_in_celery_reports() -> None:
    """Make Celery's own URL masking hide everything :func:`mask_password` hides.

    ``celery report`` and ``app.conf.humanize()`` mask result backend URLs
    with Celery's masking, which hides ``user:password@`` but keeps the
    query, where celery_zk takes ``read_only_users`` and ``keyfile_password``.
    zk:// URLs go through :func:`mask_password` instead; every other URL is
    left to Celery (:func:`celery_zk.compat.celery.wrap_url_masking`).
    Idempotent; a no-op without Celery.
    """
    from ..compat.celery import wrap_url_masking

    wrap_url_masking(mask_password, frozenset(SCHEMES))


#: Masked URL (and password) -> the URL it hides, for :func:`hide_secrets`.
_hidden: dict[tuple[str, str | None], str] = {}


def hide_secrets(url: str, password: str | None) -> str:
    """``url`` masked, remembered in this process so :func:`reveal_secrets` can undo it.

    kombu shows a Connection's ``hostname`` in ``Connection.info()`` (so in
    ``celery inspect stats`` and Flower); for a transport that parses its own
    URL that is the whole URL. The transport keeps the masked form there and
    the real one here, keyed by the mask and the password kombu keeps apart.
    """
    masked = mask_password(url)
    if masked != url:
        _hidden[(masked, password)] = url
    return masked


def reveal_secrets(url: str, password: str | None) -> str:
    """The URL :func:`hide_secrets` masked as ``url``; ``url`` itself if it did not.

    kombu's failover (``Connection.switch``) may be handed a masked URL from
    ``Connection.alt`` and then holds the mask as the password: the one URL
    masked that way is given back then.
    """
    found = _hidden.get((url, password))
    if found is None and password in (None, MASK):
        candidates = {real for (masked, _), real in _hidden.items() if masked == url}
        if len(candidates) == 1:
            found = candidates.pop()
    return url if found is None else found
