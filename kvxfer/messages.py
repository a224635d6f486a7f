"""The side channel's messages: msgspec structs (msgpack on the wire, tagged by class name) with
bounded fields, the protocol version they make, and their encoder and decoder.

A field's bound (:mod:`kvxfer.limits`) is checked by msgspec as a frame is decoded, so a message
out of bounds is refused whole before any handler sees it. The sockets that carry them, and the
:class:`~kvxfer.control.Deferred` a handler answers later with, are :mod:`kvxfer.control`'s.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from .limits import (
    MAX_CALLS,
    MAX_HEADS,
    MAX_ID_CHARS,
    MAX_LAYERS,
    MAX_MESSAGE_BYTES,
    MAX_REQUESTS,
    MAX_TOKENS,
    MAX_TP_SIZE,
    MAX_WAIT_S,
)

__all__ = [
    "HELLO_REFUSED",
    "PROTOCOL_VERSION",
    "Ack",
    "ErrorReply",
    "Heartbeat",
    "Hello",
    "HelloReply",
    "Message",
    "NixlPairReq",
    "Notify",
    "PairReq",
    "ReadReply",
    "ReadReq",
    "SendReply",
    "SendReq",
    "decode",
    "encode",
]

# 2: auth tokens, incarnations, acknowledged notifications; 3: SendReq call units; 4: tokens bound
# to one export (nonce, content digest), digests on grants and handshakes, bounded fields; 5: the
# token's MAC is keyed BLAKE2b (was HMAC-SHA256), so a version-4 peer's tokens do not verify here;
# 6: the content digest hashes a header (groups, the ids' width) and ids below 2**32 as 4 bytes
PROTOCOL_VERSION = 6

# Field types with their bounds (kvxfer.limits), checked by msgspec as a frame is decoded: a
# message out of bounds is refused whole (ErrorReply) before any handler sees it.
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
Ids = Annotated[list[Id], msgspec.Meta(max_length=MAX_REQUESTS)]
Token = Annotated[str, msgspec.Meta(max_length=64)]
Tokens = Annotated[list[Token], msgspec.Meta(max_length=MAX_REQUESTS)]
Digest = Annotated[bytes, msgspec.Meta(max_length=64)]
Digests = Annotated[list[Digest], msgspec.Meta(max_length=MAX_REQUESTS)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP_SIZE)]
TpSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]
Name = Annotated[str, msgspec.Meta(max_length=64)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_WAIT_S)]
# a cache spec as KVCacheSpec.to_dict writes it: flat, a few scalar fields
# KV cache groups ([window or 0, extra retained tokens, *layers] each: kvxfer.groups.attention)
GroupsList = Annotated[
    list[
        Annotated[
            list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]], msgspec.Meta(max_length=MAX_LAYERS + 2)
        ]
    ],
    msgspec.Meta(max_length=MAX_LAYERS),
]
# state specs of the KV cache groups (canonical JSON per group, "" for attention: kvxfer.groups.state_group)
StatesList = Annotated[
    list[Annotated[str, msgspec.Meta(max_length=2048)]], msgspec.Meta(max_length=MAX_LAYERS)
]
SpecDict = Annotated[
    dict[Name, Annotated[str, msgspec.Meta(max_length=64)] | int | bool], msgspec.Meta(max_length=32)
]


HELLO_REFUSED = "a handshake must present the token and digest of a request's params"


class Hello(msgspec.Struct, tag=True):
    """Handshake from a loader rank: who it is, what it speaks, and the capability of one
    request it holds params for (:mod:`kvxfer.auth`: its token and content digest): no
    proof, no cache description."""

    engine_id: Id
    tp_rank: Rank
    tp_size: TpSize
    spec: SpecDict
    compat: Annotated[str, msgspec.Meta(max_length=256)]
    transports: Annotated[list[Name], msgspec.Meta(max_length=8)]
    hostname: Id
    request_id: Id = ""
    token: Token = ""
    version: int = PROTOCOL_VERSION
    transport: Name = ""  # the loader's configured transport ("auto", "ipc", "pg", "nixl")
    digest: Digest = b""  # kvxfer.auth.content_digest of the request's params
    groups: GroupsList | None = None  # the engine's KV cache groups (None: one group)
    states: StatesList | None = None  # their state specs (None: no state group): GroupSet.states_wire


class HelloReply(msgspec.Struct, tag=True):
    """The exporter rank's side of the handshake."""

    engine_id: str
    tp_rank: int
    tp_size: int
    spec: dict
    compat: str
    transports: list[str]
    hostname: str
    num_blocks: int
    ipc: dict | None  # {"mapper", "caches": mapper.describe(...), "epochs": name, "num_blocks": n}
    pg: dict | None  # {"host", "port", "backend" (preferred), "backends", "units", "staging_bytes"}
    incarnation: str = ""  # random per start of the rank: a changed one means it restarted
    error: str | None = None
    version: int = PROTOCOL_VERSION
    # NIXL entry (kvxfer.transports.nixl.transport): {"agent", "md", "geometry", "epochs", "staging", "units", ...},
    # or {"why": <reason>}; None when the loader cannot use NIXL or did not ask for it
    nixl: dict | None = None
    groups: list | None = None  # the engine's KV cache groups (None: one group): GroupSet.to_wire
    states: list | None = None  # their state specs (None: no state group): GroupSet.states_wire


class ReadReq(msgspec.Struct, tag=True):
    """Check and renew the leases of ``request_ids`` (each with its token and the content
    digest of its params: block ids and tokens exactly the export's); reply with block epochs
    and, for layer-wise exports, the layers ready. ``want``: per request, the packed layer mask
    the loader still needs (empty: all layers). ``wait_s`` > 0: hold the reply (long poll, at
    most that long) until some wanted layer of some request is ready."""

    engine_id: Id
    tp_rank: Rank
    tp_size: TpSize
    request_ids: Ids
    tokens: Tokens
    want: Annotated[
        list[Annotated[bytes, msgspec.Meta(max_length=MAX_LAYERS // 8)]],
        msgspec.Meta(max_length=MAX_REQUESTS),
    ] = []
    wait_s: Seconds = 0.0
    digests: Digests = []


class ReadReply(msgspec.Struct, tag=True):
    ok: list[str]
    epochs: list[bytes]  # int64 block epochs per ok request, in ok order
    failed: dict[str, str]
    incarnation: str = ""
    layers: list[bytes] = []  # per ok request: packed mask of the layers ready (b"": all)


class PairReq(msgspec.Struct, tag=True):
    """Ask the exporter rank to join pair group ``key`` (rank 0) for ``pg`` transfers, on
    behalf of ``request_id`` (whose token and digest prove the loader holds its params)."""

    engine_id: Id
    tp_rank: Rank
    key: Id
    backend: Name
    request_id: Id
    token: Token
    digest: Digest = b""


class NixlPairReq(msgspec.Struct, tag=True):
    """Ask the exporter rank to load the loader's NIXL agent metadata (staged ``nixl`` reads
    notify the loader), on behalf of ``request_id``; ``timeout_s`` is the loader's bound (how
    long it may still read a staging buffer it was told about)."""

    engine_id: Id
    tp_rank: Rank
    agent: Id
    md: Annotated[bytes, msgspec.Meta(max_length=16 << 20)]
    timeout_s: Seconds
    request_id: Id
    token: Token
    digest: Digest = b""


class SendReq(msgspec.Struct, tag=True):
    """Gather ``calls`` (each one ops call) and stream them over ``transport``'s pair group
    (``pg``) or mailbox (staged ``nixl``) ``key`` in chunks of ``chunk_tokens`` tokens
    (:mod:`kvxfer.transports.streams`)."""

    engine_id: Id
    tp_rank: Rank
    key: Id
    request_ids: Ids
    tokens: Tokens
    head_start: Annotated[int, msgspec.Meta(ge=0, lt=MAX_HEADS)]
    num_heads: Annotated[int, msgspec.Meta(ge=1, le=MAX_HEADS)]
    unit: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]  # source unit size in tokens (1: token
    # slots, else blocks) of calls naming none
    # (int64 source unit ids, num_tokens, token offset, the call's source unit or 0 for ``unit``)
    calls: Annotated[
        list[tuple[Annotated[bytes, msgspec.Meta(max_length=MAX_MESSAGE_BYTES)], Count, Count, Count]],
        msgspec.Meta(max_length=MAX_CALLS),
    ]
    chunk_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
    layers: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_LAYERS)]], msgspec.Meta(max_length=MAX_LAYERS)
    ] = []  # the layer group to send (empty: all)
    transport: Name = "pg"  # the transport that streams it: "pg", or "nixl" (its staged path)


class SendReply(msgspec.Struct, tag=True):
    ok: bool
    failed: dict[str, str]


class Notify(msgspec.Struct, tag=True):
    """``request_ids`` are done on the loader rank (landed, or given up in ``failed``); each
    id with its token. Acknowledged (:class:`Ack`); the loader retries until it is."""

    engine_id: Id
    tp_rank: Rank
    tp_size: TpSize
    request_ids: Ids
    failed: Ids
    tokens: Annotated[list[Token], msgspec.Meta(max_length=2 * MAX_REQUESTS)]  # for request_ids + failed


class Heartbeat(msgspec.Struct, tag=True):
    """Renew the leases of loads queued but not started; acknowledged."""

    engine_id: Id
    tp_rank: Rank
    request_ids: Ids
    tokens: Tokens


class Ack(msgspec.Struct, tag=True):
    """Reply to a notification or heartbeat: ids whose token did not verify, with why."""

    failed: dict[str, str]


class ErrorReply(msgspec.Struct, tag=True):
    error: str


Message = (
    Hello
    | HelloReply
    | ReadReq
    | ReadReply
    | PairReq
    | NixlPairReq
    | SendReq
    | SendReply
    | Notify
    | Heartbeat
    | Ack
    | ErrorReply
)
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Message)


encode = _enc.encode  # msg -> bytes (the bound methods themselves: no Python frame per message)
decode = _dec.decode  # bytes -> msg; msgspec.DecodeError / ValidationError for a bad frame
