"""Payloads bigger than ``chunk_size``, stored as chunk nodes under a
*container* the caller made and gave the path of, and described by a small
*manifest* the caller stores in the node that makes the payload visible (a
result's done node, a message's body node). What a caller must do:

* write: a new container per write, :func:`write_chunks`, and only then the
  visible node with the manifest it returns;
* delete: the visible node first, its chunks in the same multi
  (:func:`chunk_paths`, :func:`commit_deleting`): the other order would
  leave, after a crash, a manifest whose chunks are partly gone;
* collect orphans (containers no visible node points at) itself
  (:func:`delete_container`).

A payload that starts with :data:`MAGIC` is chunked whatever its size. See
``docs/backend.md``, "Large results: chunks", and ``docs/design.md``, "Big
messages".
"""
from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import NodeExistsError, NoNodeError, NotEmptyError

from ..exceptions import ChunkMissing, PayloadError
from .client import connected_retry, multi_failure, reply_or_retry
from .config import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from .layout import Layout
from .names import MAX_CHUNKS

__all__ = ["IN_FLIGHT_BYTES", "MAGIC", "MAX_CHUNK_SIZE", "MIN_CHUNK_SIZE", "MULTI_DELETES",
           "Manifest", "check_chunk_size", "chunk_paths", "commit_deleting", "container_paths",
           "delete_container", "deleting",
           "delete_nodes",
           "is_manifest", "needs_chunks", "parse_manifest", "read_payload", "read_payloads",
           "write_chunks"]

MAGIC = b"\0celery_zk-chunks "
VERSION = 1
#: Chunk bytes in flight at once, reading or writing: enough to fill the pipe,
#: little enough that one big payload does not queue 16 MiB ahead of every
#: other request of the session (and in the server's buffers).
IN_FLIGHT_BYTES = 4 * 1024 * 1024
#: Deletes a caller puts in the multi with its visible node (the rest go after
#: it): ~130 bytes a delete, so the request stays far below jute.maxbuffer.
MULTI_DELETES = 1000


class Manifest(NamedTuple):
    """What the visible node holds in place of a chunked payload."""

    chunks: int    # how many
    size: int      # bytes of the whole payload
    sha256: str    # hex digest of the whole payload
    ref: str = ""  # the caller's (e.g. the token naming the container)

    def encode(self) -> bytes:
        body = {"v": VERSION, "count": self.chunks, "size": self.size,
                "sha256": self.sha256, "ref": self.ref}
        return MAGIC + json.dumps(body, separators=(",", ":")).encode()


def needs_chunks(data: bytes, chunk_size: int) -> bool:
    """True for a payload that must be stored chunked: bigger than ``chunk_size``,
    or one that would otherwise be read as a manifest."""
    return len(data) > chunk_size or data.startswith(MAGIC)


def is_manifest(data: bytes | str | None) -> bool:
    """True for a visible node's data that is a manifest (never for text)."""
    return isinstance(data, (bytes, bytearray)) and data.startswith(MAGIC)


def parse_manifest(data: bytes, where: str = "") -> Manifest:
    """The manifest in ``data`` (what a visible node holds); :class:`PayloadError`,
    naming ``where``, if it is not a whole one."""
    try:
        if not is_manifest(data):
            raise ValueError("no manifest header")
        body = json.loads(data[len(MAGIC):])
        if not isinstance(body, dict) or body.get("v") != VERSION:
            raise ValueError(f"not version {VERSION}")
        manifest = Manifest(int(body["count"]), int(body["size"]), str(body["sha256"]),
                            str(body.get("ref", "")))
        if manifest.chunks < 1 or manifest.size < 0:
            raise ValueError(body)
    except (ValueError, TypeError, KeyError) as exc:
        raise PayloadError(
            f"{where or 'The node'} does not hold a valid chunk manifest ({exc!r}): it "
            "was not written by this celery_zk (a newer release's format?), or was "
            "changed by hand. Upgrade celery_zk, or delete the node.") from None
    return manifest


def check_chunk_size(chunk_size: int) -> None:
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(
            f"chunk_size must be between {MIN_CHUNK_SIZE:,} and {MAX_CHUNK_SIZE:,} bytes "
            f"(got {chunk_size:,}): each chunk is one request, which must stay below "
            "the server's jute.maxbuffer (1 MiB).")


def write_chunks(client: KazooClient, container: str, data: bytes, chunk_size: int,
                 ref: str = "") -> bytes:
    """Store ``data`` as chunks under ``container`` (which must exist); returns the
    manifest to put in the visible node.

    Safe to call again after a connection error, with the same container and
    data: a chunk already there with the same bytes counts as written.
    """
    check_chunk_size(chunk_size)
    count = max(1, -(-len(data) // chunk_size))
    if count > MAX_CHUNKS:
        raise PayloadError(
            f"A payload of {len(data):,} bytes would take {count:,} chunks of "
            f"{chunk_size:,} bytes; at most {MAX_CHUNKS:,} are allowed. Raise chunk_size.")
    pieces = [data[i * chunk_size:(i + 1) * chunk_size] for i in range(count)]
    paths = [Layout.chunk(container, i) for i in range(count)]
    left = list(range(count))   # not yet known to be stored; shrinks across retries
    window = max(1, IN_FLIGHT_BYTES // chunk_size)

    def attempt() -> None:
        in_flight: deque[tuple[int, Any]] = deque()
        stored: set[int] = set()
        try:
            for index in left:
                if len(in_flight) >= window:
                    stored.add(_created(client, container, paths, pieces, *in_flight.popleft()))
                in_flight.append((index, client.create_async(paths[index], pieces[index])))
            while in_flight:
                stored.add(_created(client, container, paths, pieces, *in_flight.popleft()))
        finally:
            left[:] = [index for index in left if index not in stored]

    connected_retry(client, attempt)
    return Manifest(count, len(data), hashlib.sha256(data).hexdigest(), ref).encode()


def _created(client: KazooClient, container: str, paths: list[str], pieces: list[bytes],
             index: int, result: Any) -> int:
    try:
        result.get()
    except NodeExistsError:
        # A create whose reply was lost made it: the same bytes are success.
        existing, _ = client.get(paths[index])
        if existing != pieces[index]:
            raise PayloadError(
                f"{paths[index]} already holds other bytes: {container} was used for "
                "another payload. Each write needs a container of its own.") from None
    except NoNodeError:
        raise PayloadError(
            f"{container} does not exist: make the container before writing its chunks "
            "(or it was deleted meanwhile, e.g. collected as an orphan).") from None
    return index


def read_payload(client: KazooClient, container: str, data: bytes) -> bytes:
    """``data`` as read from a visible node, or, if it is a manifest, the payload
    it describes, read from the chunks under ``container`` and checked."""
    return read_payloads(client, [(container, data)])[0]


def read_payloads(client: KazooClient, items: Sequence[tuple[str, bytes]]) -> list[bytes]:
    """:func:`read_payload` of each ``(container, data)``, pipelined over all of them.

    Raises :class:`ChunkMissing` (whose ``path`` names the chunk, and so its
    container) when a chunk is gone, e.g. deleted with its payload after the
    manifest was read: read the visible node again before giving up.
    """
    out = [data for _, data in items]
    manifests = [(index, container, parse_manifest(data, container))
                 for index, (container, data) in enumerate(items) if is_manifest(data)]
    chunks = [(index, container, manifest, number)
              for index, container, manifest in manifests for number in range(manifest.chunks)]
    parts: dict[int, list[bytes]] = {index: [] for index, _, _ in manifests}
    in_flight: deque[tuple[int, str, Manifest, int, str, Any]] = deque()
    queued = 0
    for index, container, manifest, number in chunks:
        expected = -(-manifest.size // manifest.chunks)   # a chunk's size, near enough
        while in_flight and queued + expected > IN_FLIGHT_BYTES:
            queued -= _read_chunk(client, parts, *in_flight.popleft())
        path = Layout.chunk(container, number)
        in_flight.append((index, container, manifest, number, path, client.get_async(path)))
        queued += expected
    while in_flight:
        _read_chunk(client, parts, *in_flight.popleft())
    for index, container, manifest in manifests:
        out[index] = _checked(b"".join(parts[index]), container, manifest)
    return out


def _read_chunk(client: KazooClient, parts: dict[int, list[bytes]], index: int,
                container: str, manifest: Manifest, number: int, path: str,
                result: Any) -> int:
    try:
        data, _ = reply_or_retry(client, result, client.get, path)
    except NoNodeError:
        raise ChunkMissing(
            f"{path} is missing: chunk {number + 1} of {manifest.chunks} of the "
            f"{manifest.size:,}-byte payload stored under {container}. The payload "
            "was deleted meanwhile (with its node), or the chunk by hand.", path) from None
    parts[index].append(data)
    return -(-manifest.size // manifest.chunks)


def _checked(payload: bytes, container: str, manifest: Manifest) -> bytes:
    if len(payload) != manifest.size:
        raise PayloadError(
            f"The chunks under {container} hold {len(payload):,} bytes; their manifest "
            f"says {manifest.size:,}. The payload was changed by hand, or is corrupt: "
            "delete it and its node.")
    if hashlib.sha256(payload).hexdigest() != manifest.sha256:
        raise PayloadError(
            f"The chunks under {container} do not match their manifest's sha256. The "
            "payload was changed by hand, or is corrupt: delete it and its node.")
    return payload


def chunk_paths(container: str, manifest: bytes | Manifest) -> list[str]:
    """Every chunk of a payload, then its container: the order deletes must go.

    The first :data:`MULTI_DELETES` go into the multi that deletes (or
    replaces) the visible node; the rest to :func:`delete_nodes` after it.
    """
    parsed = manifest if isinstance(manifest, Manifest) else parse_manifest(manifest, container)
    return [*(Layout.chunk(container, i) for i in range(parsed.chunks)), container]


def commit_deleting(client: KazooClient, build: Callable[[TransactionRequest], None],
                    paths: Sequence[str]) -> tuple[int, Exception] | None:
    """Commit the ops ``build`` adds to a multi (deleting or replacing a visible
    node) together with the deletes of ``paths`` (its old payload, from
    :func:`chunk_paths`); returns the failure of ``build``'s own ops, or None.

    Up to :data:`MULTI_DELETES` deletes go in the multi, the rest right after it
    (see the module docstring for why the visible node goes first). If the
    chunks were gone already (deleted meanwhile), ``build``'s ops are committed
    alone, and whatever is left of them deleted after. ``build`` may be called
    twice.
    """
    tx = client.transaction()
    build(tx)
    own = len(tx.operations)
    for path in paths[:MULTI_DELETES]:
        tx.delete(path)
    failure = multi_failure(tx.commit())
    rest = paths[MULTI_DELETES:]
    if failure is not None and failure[0] >= own:
        tx = client.transaction()
        build(tx)
        failure = multi_failure(tx.commit())
        rest = paths
    if failure is None:
        delete_nodes(client, rest)
    return failure


def deleting(path: str, version: int) -> Callable[[TransactionRequest], None]:
    """What :func:`commit_deleting` builds to delete ``path`` at ``version``."""
    def delete(tx: TransactionRequest) -> None:
        tx.delete(path, version=version)
    return delete


def delete_nodes(client: KazooClient, paths: Sequence[str]) -> None:
    """Delete ``paths`` in order, pipelined (one session's requests are applied in
    order, so chunks go before their container); nodes already gone are skipped.
    A container that still has children (chunks its manifest does not name) is
    emptied and deleted."""
    def attempt() -> None:
        results = [(path, client.delete_async(path)) for path in paths]
        for path, result in results:
            try:
                result.get()
            except NoNodeError:
                pass
            except NotEmptyError:
                delete_container(client, path)

    if paths:
        client.retry(attempt)


def container_paths(client: KazooClient, container: str) -> list[str]:
    """Whatever chunks a container holds, then the container, in the order
    their deletes must go; none where it is gone."""
    try:
        names = client.retry(client.get_children, container)
    except NoNodeError:
        return []
    return [*(Layout.listed(container, name) for name in sorted(names)), container]


def delete_container(client: KazooClient, container: str) -> None:
    """Delete a container and whatever chunks it holds (an orphan: its manifest is
    not known, or it was never written whole)."""
    delete_nodes(client, container_paths(client, container))
