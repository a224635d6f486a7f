"""KVTransferParams: what :meth:`TransferEngine.export` returns and :meth:`TransferEngine.load` takes.

One plain, JSON-safe dict per request, so a proxy can pass it in an HTTP response; a list of
them for parallel sampling (n>1), one per child request. Every TP rank of the exporting engine
returns the same dict: rank ``r`` of the exporter listens on ``port + r`` of ``host``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PARAMS_VERSION", "KVTransferParams"]

PARAMS_VERSION = 1


def _int(d: dict, field: str, minimum: int) -> int:
    v = d.get(field)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{field}: must be an int >= {minimum}, got {v!r}")
    return v


def _str(d: dict, field: str) -> str:
    v = d.get(field)
    if not isinstance(v, str) or not v:
        raise ValueError(f"{field}: must be a non-empty string, got {v!r}")
    return v


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
        version: params format version.
    """

    request_id: str
    engine_id: str
    host: str
    port: int
    tp_size: int
    block_ids: tuple[int, ...]
    num_tokens: int
    version: int = PARAMS_VERSION

    def to_dict(self) -> dict:
        """JSON-safe dict (lists and scalars only)."""
        return {
            "request_id": self.request_id,
            "engine_id": self.engine_id,
            "host": self.host,
            "port": self.port,
            "tp_size": self.tp_size,
            "block_ids": list(self.block_ids),
            "num_tokens": self.num_tokens,
            "version": self.version,
        }

    @classmethod
    def from_dict(cls, d: dict | list | KVTransferParams) -> KVTransferParams | list[KVTransferParams]:
        """Validate a params dict (or a list of them, for n>1); ``ValueError`` naming the field."""
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
            if tp_size > 1 and port + tp_size - 1 > 65535:
                raise ValueError(f"port: port + tp_size - 1 exceeds 65535 ({port} + {tp_size - 1})")
            num_tokens = _int(d, "num_tokens", 1)
            ids = d.get("block_ids")
            if not isinstance(ids, (list, tuple)) or not ids:
                raise ValueError(f"block_ids: must be a non-empty list of ints, got {type(ids).__name__}")
            for x in ids:
                if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                    raise ValueError(f"block_ids: must hold non-negative ints, got {x!r}")
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None
        return cls(request_id, engine_id, host, port, tp_size, tuple(ids), num_tokens, version)
