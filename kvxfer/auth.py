"""Who may talk to an engine rank's side channel: the params are the capability.

Every exporting engine has a secret. ``export()`` puts into the request's params a *token*,
``HMAC-SHA256(secret, request_id)`` (truncated to 128 bits, hex). A loader presents the
(request id, token) pairs of the params it holds with every message that touches a request
(lease grants, send requests, notifications, heartbeats) and one such pair with its handshake;
a rank answers a message whose pairs do not verify with an error and nothing else — no cache
description, no shared-memory names or CUDA IPC handles, no lease, no release. A token opens
one request only, so a decode engine that received one request's params cannot read or free
another's.

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
from pathlib import Path

__all__ = ["AUTH_KEY_ENV", "UNAUTHORIZED", "EngineSecret", "request_token", "tokens_match"]

_LOG = logging.getLogger(__name__)

AUTH_KEY_ENV = "KVXFER_AUTH_KEY"
_SECRET_BYTES = 32
_TOKEN_BYTES = 16


def request_token(secret: bytes, request_id: str) -> str:
    """The token of ``request_id`` under ``secret`` (32 hex characters)."""
    return hmac.new(secret, request_id.encode(), hashlib.sha256).digest()[:_TOKEN_BYTES].hex()


class _KeyedSha256:
    """HMAC-SHA256 under one key with the key's inner and outer hash states computed once
    (RFC 2104): a token then costs two state copies and two short hashes, ~1.0 us here where
    ``hmac.new`` per token took ~2.7 us (4.2 us for ``hmac.digest``) on the 2-core CI machine.
    Same bytes as :func:`request_token` (tests/test_auth.py checks it)."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        if len(key) > 64:  # the SHA-256 block size: longer keys are hashed first
            key = hashlib.sha256(key).digest()
        key = key.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def token(self, request_id: str) -> str:
        inner = self._inner.copy()
        inner.update(request_id.encode())
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()[:_TOKEN_BYTES].hex()


UNAUTHORIZED = "unauthorized: the token does not match the request (params of another engine or forged)"


def tokens_match(expected: str, presented: object) -> bool:
    """Constant-time comparison of a presented token with the expected one. (The exporter's
    tracker runs this same test inline in its grant and notification loops, one request after
    another, without a call per request: ``kvxfer.tracker.ExportTracker.grant``.)"""
    return isinstance(presented, str) and hmac.compare_digest(expected, presented)


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

    ``token(request_id)`` gives the token of a request (:func:`request_token` under the secret).
    """

    def __init__(
        self, engine_id: str, port: int, tp_rank: int, auth_key: str | None = None, timeout_s: float = 10.0
    ) -> None:
        key = auth_key if auth_key is not None else os.environ.get(AUTH_KEY_ENV)
        self.path: Path | None = None
        self._owner = tp_rank == 0
        if key:
            self.secret = hmac.new(key.encode(), engine_id.encode(), hashlib.sha256).digest()
            self.source = "cluster key"
        elif port == 0:
            self.secret = secrets.token_bytes(_SECRET_BYTES)
            self.source = "random (single rank)"
        else:
            self.path = key_path(engine_id, port)
            self.secret = self._shared(self.path, timeout_s)
            self.source = f"host key file {self.path}"
        # token(request_id) -> the request's token (request_token under this engine's secret):
        # the keyed hash's own method, so a token costs no wrapper frame (one per export()).
        self.token = _KeyedSha256(self.secret).token

    @staticmethod
    def _shared(path: Path, timeout_s: float) -> bytes:
        """Read the host key file, creating it (atomically, 0600) when absent."""
        deadline = time.monotonic() + timeout_s
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
                return data
            if data is None:
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kvxfer-key-")
                try:
                    os.write(fd, secrets.token_bytes(_SECRET_BYTES))
                    os.fchmod(fd, 0o600)
                finally:
                    os.close(fd)
                try:
                    os.link(tmp, path)  # atomic create-if-absent: one rank's secret wins
                except FileExistsError:
                    pass
                finally:
                    os.unlink(tmp)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"auth: key file {path} holds {len(data)} bytes, not {_SECRET_BYTES}")
            time.sleep(0.01)

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
