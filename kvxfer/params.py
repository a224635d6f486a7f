"""KVTransferParams: what :meth:`TransferEngine.export` returns and :meth:`TransferEngine.load` takes.

One plain, JSON-safe dict per request, so a proxy can pass it in an HTTP response; a list of
them for parallel sampling (n>1), one per child request. Every TP rank of the exporting engine
returns the same dict: rank ``r`` of the exporter listens on ``port + r`` of ``host``. The
dict is the capability to read and release that request: its ``token`` (see
:mod:`kvxfer.auth`) is presented with every message about it, so treat params like a password.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from . import idops
from .auth import TOKEN_CHARS, content_digest
from .limits import MAX_ID_CHARS, MAX_TOKENS, MAX_TP_SIZE

__all__ = ["PARAMS_VERSION", "KVTransferParams", "block_id_array", "group_sizes", "params_dict"]

PARAMS_VERSION = 3  # 2: the request's auth token; 3: tokens bound to one export (kvxfer.auth)


def _int(d: dict, field: str, minimum: int) -> int:
    v = d.get(field)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{field}: must be an int >= {minimum}, got {v!r}")
    return v


def block_id_array(ids: object, field: str = "block_ids") -> np.ndarray:
    """Non-negative ints (list/tuple) -> read-only uint64 array; ``ValueError`` naming ``field``.

    uint64, so one ``max() < num_blocks`` check bounds the ids on both ends before they are
    viewed as int64.
    One C conversion (``array('Q')`` rejects floats, strings and negative ids itself) instead
    of a Python check per element. Bools are rejected too; they can
    only hide among ids equal to 0 or 1, so only then is the list scanned.
    """
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(f"{field}: must be a non-empty list of ints, got {type(ids).__name__}")
    try:
        raw = array.array("Q", ids)
    except (TypeError, OverflowError):
        bad = next(
            (x for x in ids if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 2**63), None
        )
        raise ValueError(f"{field}: must hold non-negative ints, got {bad!r}") from None
    out = np.frombuffer(raw, dtype=np.uint64)
    if out.min() <= 1 and any(type(ids[i]) is bool for i in np.flatnonzero(out <= 1).tolist()):
        raise ValueError(f"{field}: must hold non-negative ints, got a bool")
    out.flags.writeable = False
    return out


_NonEmpty = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]


_U64 = np.dtype(np.uint64)
# the bounds params_fields (and LoadBook.begin) check a params dict against
FIELD_LIMITS = (MAX_ID_CHARS, TOKEN_CHARS, MAX_TP_SIZE, MAX_TOKENS, PARAMS_VERSION)


class _Shape(msgspec.Struct):
    """The params fields with their types and bounds, checked by one ``msgspec.convert`` call;
    the block ids are only carried through here (``Any``: ``tuple[int, ...]`` walked them once
    more than needed) and checked by what
    follows: a list of plain ints (:func:`kvxfer.idops.exact_ints`: no bool, no float, no
    subclass), converted to uint64 (:func:`kvxfer.idops.as_uint64`, which rejects negative ids).
    A dict that fails any of it goes through the field-by-field checks of
    :meth:`KVTransferParams._one`, which name the problem."""

    request_id: _NonEmpty
    engine_id: _NonEmpty
    host: _NonEmpty
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]
    block_ids: Any  # checked after the convert (see above)
    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
    token: Annotated[str, msgspec.Meta(min_length=TOKEN_CHARS, max_length=TOKEN_CHARS)]
    version: int = PARAMS_VERSION
    groups: Any = None  # checked after the convert (:func:`group_sizes`)


def _str(d: dict, field: str) -> str:
    v = d.get(field)
    if not isinstance(v, str) or not v:
        raise ValueError(f"{field}: must be a non-empty string, got {v!r}")
    if len(v) > MAX_ID_CHARS:
        raise ValueError(f"{field}: must be at most {MAX_ID_CHARS} characters, got {len(v)}")
    return v


def group_sizes(groups: object, num_ids: int) -> tuple[int, ...] | None:
    """The params' ``groups`` field checked: None (a request of one group), or a non-empty list
    of positive ints (block ids per KV cache group, :mod:`kvxfer.grouped`) summing to the
    ``num_ids`` block ids; ``ValueError`` naming ``groups`` otherwise."""
    if groups is None:
        return None
    if (
        not isinstance(groups, (list, tuple))
        or not groups
        or not all(type(x) is int and x > 0 for x in groups)
        or sum(groups) != num_ids
    ):
        raise ValueError(
            f"groups: must be a non-empty list of positive ints summing to the {num_ids} block ids, "
            f"got {groups!r:.80}"
        )
    return tuple(groups)


def params_dict(
    request_id: str,
    engine_id: str,
    host: str,
    port: int,
    tp_size: int,
    block_ids: list[int],
    num_tokens: int,
    token: str,
    version: int = PARAMS_VERSION,
    groups: list[int] | None = None,
) -> dict:
    """The params dict of :meth:`KVTransferParams.to_dict`, built without the dataclass (the
    exporter's hot path; ``block_ids`` must already be a list of Python ints). ``groups``
    (block ids per KV cache group) appears only for a request of several groups."""
    d = {
        "request_id": request_id,
        "engine_id": engine_id,
        "host": host,
        "port": port,
        "tp_size": tp_size,
        "block_ids": block_ids,
        "num_tokens": num_tokens,
        "token": token,
        "version": version,
    }
    if groups is not None:
        d["groups"] = list(groups)
    return d


@dataclass(frozen=True)
class KVTransferParams:
    """Where a request's KV lives on the exporting engine.

    Args:
        request_id: the exporter's request id (a child's own id for n>1).
        engine_id: id of the exporting engine.
        host: host of the exporter's side channel.
        port: side-channel port of exporter rank 0; rank ``r`` listens on ``port + r``.
        tp_size: TP size of the exporter.
        block_ids: the request's block ids on the exporter, in token order (same on every rank);
            exactly ``ceil(num_tokens / block_size)`` of them.
        num_tokens: tokens to move (the last block may be partial).
        token: the capability of this one export (:mod:`kvxfer.auth`: bound to the request
            id, ``block_ids``, ``num_tokens`` and ``groups``): presented with every message
            about it.
        version: params format version.
        groups: for an exporter registered with KV cache groups (:mod:`kvxfer.grouped`), how
            many of ``block_ids`` (each group's live blocks, in group order) belong to each
            group; None for a request of one group.
    """

    request_id: str
    engine_id: str
    host: str
    port: int
    tp_size: int
    block_ids: tuple[int, ...]
    num_tokens: int
    token: str
    version: int = PARAMS_VERSION
    groups: tuple[int, ...] | None = None

    def to_dict(self) -> dict:
        """JSON-safe dict (lists and scalars only)."""
        return params_dict(
            self.request_id,
            self.engine_id,
            self.host,
            self.port,
            self.tp_size,
            list(self.block_ids),
            self.num_tokens,
            self.token,
            self.version,
            self.groups,
        )

    @classmethod
    def from_dict(cls, d: dict | list | KVTransferParams) -> KVTransferParams | list[KVTransferParams]:
        """Validate a params dict (or a list of them, for n>1); ``ValueError`` naming the field."""
        if type(d) is dict:  # the common case first: one check of the whole dict
            return cls._checked_at_once(d) or cls._fields(d, "")
        if isinstance(d, KVTransferParams):
            return d
        if isinstance(d, list):
            if not d:
                raise ValueError("params: an n>1 params list must not be empty")
            return [cls._one(x, f"params[{i}].") for i, x in enumerate(d)]
        return cls._one(d, "")

    @classmethod
    def _one(cls, d: object, where: str) -> KVTransferParams:
        if isinstance(d, KVTransferParams):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"{where or 'params'}: expected a dict, got {type(d).__name__}")
        return cls._checked_at_once(d) or cls._fields(d, where)

    @classmethod
    def _fields(cls, d: dict, where: str) -> KVTransferParams:
        """The params of ``d`` checked field by field: ``ValueError`` naming the first bad one."""
        try:
            version = d.get("version", PARAMS_VERSION)
            if version != PARAMS_VERSION:
                raise ValueError(f"version: unsupported params version {version!r} (want {PARAMS_VERSION})")
            request_id = _str(d, "request_id")
            engine_id = _str(d, "engine_id")
            host = _str(d, "host")
            port = _int(d, "port", 1)
            if port > 65535:
                raise ValueError(f"port: must be <= 65535, got {port}")
            tp_size = _int(d, "tp_size", 1)
            if tp_size > MAX_TP_SIZE:
                raise ValueError(f"tp_size: must be <= {MAX_TP_SIZE}, got {tp_size}")
            if tp_size > 1 and port + tp_size - 1 > 65535:
                raise ValueError(f"port: port + tp_size - 1 exceeds 65535 ({port} + {tp_size - 1})")
            num_tokens = _int(d, "num_tokens", 1)
            if num_tokens > MAX_TOKENS:
                raise ValueError(f"num_tokens: must be <= {MAX_TOKENS}, got {num_tokens}")
            token = d.get("token")
            if not isinstance(token, str) or len(token) != TOKEN_CHARS:
                raise ValueError(
                    f"token: must be the {TOKEN_CHARS}-character hex token export() made, got {token!r:.80}"
                )
            ids = d.get("block_ids")
            arr = block_id_array(ids)
            groups = group_sizes(d.get("groups"), arr.size)
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None
        out = cls(request_id, engine_id, host, port, tp_size, tuple(ids), num_tokens, token, version, groups)
        object.__setattr__(out, "_ids", arr)  # cached; not a field (eq/repr unchanged)
        return out

    @classmethod
    def _checked_at_once(cls, d: dict) -> KVTransferParams | None:
        """The params of ``d`` when one call finds every field good (the common case): the
        native module's (:func:`kvxfer.idops.params_fields`), else one ``msgspec.convert`` and
        the id checks; None otherwise, and the field checks of :meth:`_one` name what is
        wrong."""
        got = idops.params_fields(d, FIELD_LIMITS)
        if got is not None:  # the fields as __init__ would set them, the ids' array and digest
            fields, raw, fields["_digest"] = got
            fields["_ids"] = np.frombuffer(raw, _U64)  # read-only: bytes
            out = object.__new__(cls)
            object.__setattr__(out, "__dict__", fields)
            return out
        try:
            f = msgspec.convert(d, _Shape)
        except msgspec.ValidationError:
            return None
        ids = f.block_ids
        if (
            f.version != PARAMS_VERSION
            or f.port + f.tp_size - 1 > 65535
            or type(ids) is not list
            or not ids
            or not idops.exact_ints(ids)
        ):
            return None
        try:
            arr = idops.as_uint64(ids)
            groups = group_sizes(f.groups, len(ids))
        except (OverflowError, TypeError, ValueError):  # the field checks of _one say what
            return None
        arr.flags.writeable = False
        # The fields as __init__ would set them, without a frozen dataclass's object.__setattr__
        # per field, paid per load() (profiling/results/2026-11-23-cpu-hostcost/README.md).
        out = object.__new__(cls)
        out.__dict__.update(
            request_id=f.request_id,
            engine_id=f.engine_id,
            host=f.host,
            port=f.port,
            tp_size=f.tp_size,
            block_ids=tuple(ids),
            num_tokens=f.num_tokens,
            token=f.token,
            version=f.version,
            groups=groups,
            _ids=arr,
        )
        return out

    def block_id_array(self) -> np.ndarray:
        """``block_ids`` as a read-only uint64 array (computed once per params object)."""
        arr = self.__dict__.get("_ids")
        if arr is None:
            arr = block_id_array(list(self.block_ids))
            object.__setattr__(self, "_ids", arr)
        return arr

    def digest(self) -> bytes:
        """:func:`kvxfer.auth.content_digest` of ``num_tokens`` and ``block_ids`` (computed once):
        what grants and handshakes carry, so the exporter refuses params whose ids or token
        count differ from its export's."""
        dg = self.__dict__.get("_digest")
        if dg is None:
            dg = content_digest(self.num_tokens, self.block_id_array(), self.groups)
            object.__setattr__(self, "_digest", dg)
        return dg
