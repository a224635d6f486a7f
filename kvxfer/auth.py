"""Who may talk to an engine rank's side channel: the params are the capability.

Every exporting engine has a secret. ``export()`` puts into the request's params a *token* that
binds the request id to that one export and its contents:

    token   = nonce (8 bytes) || MAC, as 48 hex characters
    MAC     = BLAKE2b-128 keyed with the secret (RFC 7693), of request_id || 0 || nonce || digest
    digest  = BLAKE2b-128(num_tokens || groups || block ids), :func:`content_digest`

The nonce is the export's *generation* of its request id on the rank (0 for the first export
of an id, one more for each later export after the earlier one was released: identical on
every rank of an engine, which all export the same requests), or random when a process
without an engine makes the token (:meth:`EngineSecret.new_token`, e.g. vLLM's scheduler, which
then hands it to every rank's ``export(..., token=...)``). So params opened by one export never
open a later export of the same request id, and params whose block ids or token count were
changed no longer match the digest the exporter holds.

A loader presents the (request id, token) pairs of the params it holds with every message that
touches a request (lease grants, send requests, notifications, heartbeats) and one such pair
with its handshake; lease grants and handshakes also carry the params' digests. A rank answers
a message whose pairs do not verify with an error and nothing else: no cache description, no
shared-memory names or CUDA IPC handles, no lease, no release. A token opens one export only,
so a decode engine that received one request's params cannot read or free another's.

Where the secret comes from (no configuration needed):

* default: the ranks of one engine on one host share a random 256-bit secret through a key
  file only the user can read (``$XDG_RUNTIME_DIR`` or ``/dev/shm``, mode 0600, named after
  the user, the engine id and the base port). The first rank to start creates it atomically;
  the others read it; rank 0 removes it at ``close()``, so the next start of the engine draws
  a new secret. An engine whose ranks run on different hosts needs the cluster key below.
* a cluster-wide key (``TransferEngine(auth_key=...)`` or ``$KVXFER_AUTH_KEY``, any string):
  the secret is ``HMAC-SHA256(key, engine_id)``, the same on every host, and no file is used.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import idops

__all__ = [
    "AUTH_KEY_ENV",
    "TOKEN_CHARS",
    "UNAUTHORIZED",
    "EngineSecret",
    "content_digest",
    "export_token",
    "request_token",
    "tokens_match",
]

_LOG = logging.getLogger(__name__)

AUTH_KEY_ENV = "KVXFER_AUTH_KEY"
_SECRET_BYTES = 32
_MAC_BYTES = 16
_NONCE_BYTES = 8
DIGEST_BYTES = 16
_blake2b = hashlib.blake2b
# native int64 / uint64 (the ids' bytes are the digest's input as they are on a little-endian host)
_I64, _U64 = (np.dtype(t) if np.little_endian else None for t in (np.int64, np.uint64))
# Bytes hashed per update: hashlib releases the GIL for an update of 2048 bytes or more, and
# taking it back waits for the engine's other threads, so a 4K-token request's ids hashed in one
# such update made the digest's cost depend on those threads; smaller updates keep the GIL
# (profiling/results/2026-11-26-cpu-onesided-hostcost).
_BYTES_PER_UPDATE = 2040
_U32_MAX = (1 << 32) - 1
TOKEN_CHARS = 2 * (_NONCE_BYTES + _MAC_BYTES)  # 48 hex characters


def _native():
    """The native module's ``content_digest`` and ``token`` (``csrc/ctl/token_hash.h``) when it
    is in use (:func:`kvxfer.idops.native`), else None: hashlib computes the same bytes."""
    return idops.native()


def _id_bytes(block_ids: np.ndarray) -> np.ndarray:
    """``block_ids`` (non-negative ids) as a C-contiguous 8-byte int array: the digest's input as
    it is (int64 or uint64), else a little-endian int64 copy."""
    dt = block_ids.dtype
    if (dt is _I64 or dt is _U64) and block_ids.flags.c_contiguous:
        return block_ids
    return np.ascontiguousarray(block_ids.view(np.int64) if dt == np.uint64 else block_ids, dtype="<i8")


def _digest_input(
    num_tokens: int, block_ids: np.ndarray, groups: Sequence[int] | None
) -> tuple[bytes, np.ndarray]:
    """The content digest's header and the ids as hashed (see :func:`content_digest`)."""
    narrow = not block_ids.size or int(block_ids.view(np.uint64).max()) <= _U32_MAX
    head = b"".join((
        num_tokens.to_bytes(8, "little"),
        b"\x01" if groups is not None else b"\x00",
        (len(groups) if groups is not None else 0).to_bytes(4, "little"),
        b"\x04" if narrow else b"\x08",
    ))  # fmt: skip
    return head, block_ids.astype("<u4") if narrow else block_ids


def content_digest(num_tokens: int, block_ids: np.ndarray, groups: Sequence[int] | None = None) -> bytes:
    """What a token binds besides the request id: BLAKE2b-128 of a 14-byte header (``num_tokens``
    as 8 bytes little-endian; 1 when ``groups`` is given, else 0; the number of groups as 4
    bytes; the ids' width, 4 when every id is below 2**32, else 8), then ``groups`` (a request of
    several KV cache groups, :mod:`kvxfer.grouped`: how many of the ids belong to each, 8 bytes
    each), then the block ids at that width, little-endian (``block_ids``: an int64 or uint64
    array of non-negative ids, the exporter's checked array or the params' own). Every field's
    length is fixed by the header, so no two inputs hash the same bytes; 4-byte ids halve what
    is hashed for every real cache. One native call when the control module is loaded, else
    hashlib (the same bytes)."""
    block_ids = _id_bytes(block_ids)
    mod = _native()
    if mod is not None:
        g = None if groups is None else np.ascontiguousarray(groups, dtype="<i8")
        return mod.content_digest(num_tokens, block_ids, g)
    head, ids = _digest_input(num_tokens, block_ids, groups)
    h = _blake2b(head, digest_size=DIGEST_BYTES)
    if groups is not None:
        h.update(np.asarray(groups, dtype="<i8").tobytes())
    step = _BYTES_PER_UPDATE // ids.itemsize
    if ids.size <= step:  # the bytes as they are
        h.update(ids)
    else:
        for k in range(0, ids.size, step):
            h.update(ids[k : k + step])
    return h.digest()


def export_token(
    secret: bytes, request_id: str, nonce: bytes, num_tokens: int, block_ids: np.ndarray, groups=None
) -> tuple[str, bytes]:
    """``(token, digest)`` of an export: :func:`request_token` of :func:`content_digest`, in one
    native call when the control module is loaded (what ``export()`` makes per request)."""
    mod = _native()
    if mod is None:
        digest = content_digest(num_tokens, block_ids, groups)
        return request_token(secret, request_id, nonce, digest), digest
    g = None if groups is None else np.ascontiguousarray(groups, dtype="<i8")
    return mod.export_token(secret, request_id, nonce, num_tokens, _id_bytes(block_ids), g)


def _mac_input(request_id: str, nonce: bytes, digest: bytes) -> bytes:
    return b"".join((request_id.encode(), b"\0", nonce, digest))


def request_token(secret: bytes, request_id: str, nonce: bytes, digest: bytes) -> str:
    """The token of ``request_id`` under ``secret`` (1 to 64 bytes) for the export with
    ``nonce`` (8 bytes) and content ``digest`` (:func:`content_digest`): 48 hex characters (see
    the module doc). One native call when the control module is loaded, else hashlib."""
    mod = _native()
    if mod is not None:
        return mod.token(secret, request_id, nonce, digest)
    mac = _blake2b(_mac_input(request_id, nonce, digest), key=secret, digest_size=_MAC_BYTES)
    return nonce.hex() + mac.hexdigest()


UNAUTHORIZED = "unauthorized: the token does not match the request (params of another engine or forged)"


def tokens_match(expected: str, presented: object) -> bool:
    """Constant-time comparison of a presented token with the expected one. (The exporter's
    tracker runs this same test inline in its grant and notification loops, one request after
    another, without a call per request: ``kvxfer.exports.ExportTracker.grant``.)"""
    return isinstance(presented, str) and presented.isascii() and hmac.compare_digest(expected, presented)


def _key_dir() -> Path:
    run = os.environ.get("XDG_RUNTIME_DIR")
    for cand in (run, "/dev/shm", tempfile.gettempdir()):
        if cand and os.path.isdir(cand) and os.access(cand, os.W_OK):
            return Path(cand)
    raise RuntimeError(
        "auth: no writable directory for the engine key file ($XDG_RUNTIME_DIR, /dev/shm, tmp)"
    )


def key_path(engine_id: str, port: int) -> Path:
    """Where the ranks of engine ``engine_id`` (base port ``port``) on this host keep their secret."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:80]
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:8]
    return _key_dir() / f"kvxfer-{os.getuid()}-{safe}-{digest}-{port}.key"


class EngineSecret:
    """The secret of one engine rank (see the module doc) and what to clean up at close.

    Args:
        engine_id: the engine's id (all ranks alike).
        port: the engine's base side-channel port (0: a single-rank engine on a free port,
            whose secret is simply random and never shared).
        tp_rank: this rank; rank 0 removes the key file at :meth:`close`.
        auth_key: a cluster-wide key (else ``$KVXFER_AUTH_KEY``, else the host key file).
        timeout_s: how long to wait for another rank's half-written key file.

    :meth:`token` makes the token of one export, :meth:`new_token` one with a random nonce
    (for a process without an engine), :meth:`verify` checks a presented one,
    :meth:`for_export` makes or checks the token ``export()`` puts in its params.
    """

    def __init__(
        self, engine_id: str, port: int, tp_rank: int, auth_key: str | None = None, timeout_s: float = 10.0
    ) -> None:
        key = auth_key if auth_key is not None else os.environ.get(AUTH_KEY_ENV)
        self.path: Path | None = None
        self.created = False  # this instance wrote the host key file (no other rank had yet)
        self._owner = tp_rank == 0
        self.engine_id = engine_id
        if key:
            self.secret = hmac.new(key.encode(), engine_id.encode(), hashlib.sha256).digest()
            self.source = "cluster key"
        elif port == 0:
            self.secret = secrets.token_bytes(_SECRET_BYTES)
            self.source = "random (single rank)"
        else:
            self.path = key_path(engine_id, port)
            self.secret, self.created = self._shared(self.path, timeout_s)
            self.source = f"host key file {self.path}"

    def token(self, request_id: str, nonce: bytes, digest: bytes) -> str:
        """The token of the export of ``request_id`` with ``nonce`` (8 bytes: the export's
        generation, or random) and content ``digest`` (:func:`content_digest`)."""
        return request_token(self.secret, request_id, nonce, digest)

    def export_token(
        self, request_id: str, nonce: bytes, num_tokens: int, block_ids: np.ndarray, groups=None
    ) -> tuple[str, bytes]:
        """``(token, content digest)`` of the export of ``request_id`` with ``nonce`` holding
        ``block_ids`` (an int array) and ``num_tokens`` (:func:`export_token`)."""
        return export_token(self.secret, request_id, nonce, num_tokens, block_ids, groups)

    def for_export(
        self,
        request_id: str,
        gen: int,
        num_tokens: int,
        block_ids: np.ndarray,
        token: str | None,
        groups=None,
    ) -> tuple[str, bytes]:
        """``(token, content digest)`` of the export of ``request_id`` with generation ``gen``
        holding ``block_ids`` and ``num_tokens`` (``groups``: ids per group): the generation's
        token (the same on every rank), or ``token`` when this secret made it for that content
        (any nonce: a token handed out before the export, :meth:`new_token`); ``ValueError``
        when it did not."""
        if token is None:
            return self.export_token(request_id, gen.to_bytes(8, "big"), num_tokens, block_ids, groups)
        digest = content_digest(num_tokens, block_ids, groups)
        if not self.verify(request_id, token, digest):
            raise ValueError(
                f"token: not a token of engine {self.engine_id!r} for request {request_id!r} with these "
                "block ids and num_tokens"
            )
        return token, digest

    def new_token(
        self, request_id: str, num_tokens: int, block_ids, groups: Sequence[int] | None = None
    ) -> str:
        """A token for an export of ``request_id`` holding ``block_ids`` (ints, in token order)
        and ``num_tokens``, with a random nonce: what a process that hands params out before
        the engine ranks export (vLLM's scheduler) gives every rank's ``export(..., token=)``.
        ``groups``: ids per KV cache group, for an engine with groups (:mod:`kvxfer.grouped`)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        digest = content_digest(num_tokens, ids, groups)
        return self.token(request_id, secrets.token_bytes(_NONCE_BYTES), digest)

    def verify(self, request_id: str, token: object, digest: object) -> bool:
        """Whether ``token`` was made by this secret for ``request_id`` and content ``digest``
        (any nonce): the test for a request not exported here (yet, or any more)."""
        if (
            type(token) is not str
            or len(token) != TOKEN_CHARS
            or not token.isascii()
            or type(digest) is not bytes
        ):
            return False
        try:
            nonce = bytes.fromhex(token[: 2 * _NONCE_BYTES])
        except ValueError:
            return False
        return hmac.compare_digest(self.token(request_id, nonce, digest), token)

    @staticmethod
    def _shared(path: Path, timeout_s: float) -> tuple[bytes, bool]:
        """Read the host key file, creating it (atomically, 0600) when absent; (the secret,
        whether this call created it)."""
        deadline = time.monotonic() + timeout_s
        created = False
        while True:
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                data = None
            if data is not None and len(data) == _SECRET_BYTES:
                st = path.stat()
                if st.st_uid != os.getuid() or st.st_mode & 0o077:
                    raise RuntimeError(
                        f"auth: key file {path} is not private to this user (mode {st.st_mode:o})"
                    )
                return data, created
            if data is None:
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kvxfer-key-")
                try:
                    os.write(fd, secrets.token_bytes(_SECRET_BYTES))
                    os.fchmod(fd, 0o600)
                finally:
                    os.close(fd)
                try:
                    os.link(tmp, path)  # atomic create-if-absent: one rank's secret wins
                    created = True
                except FileExistsError:
                    pass
                finally:
                    os.unlink(tmp)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"auth: key file {path} holds {len(data)} bytes, not {_SECRET_BYTES}")
            time.sleep(0.01)

    def remove_file(self) -> None:
        """Remove the host key file now, whatever this rank (for a process that knows every rank
        has read it: vLLM's scheduler, built after its workers started their engines). The
        secret stays in memory; a process killed later leaves no file behind."""
        self._owner = True
        self.close()

    def close(self) -> None:
        """Rank 0 removes the host key file, so the next start of the engine draws a new secret."""
        if self.path is not None and self._owner:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                _LOG.warning("kvxfer auth: could not remove key file %s (%s)", self.path, e)
            self.path = None
