"""Bounds on what a peer may ask of a rank: every field of a side-channel message
(:mod:`kvxfer.control`) and of params (:mod:`kvxfer.params`) is checked against these when it
is decoded, before a handler does any work for it, so no field of an unchecked message makes
work or memory in proportion to its value. Far above what serving needs: TP sizes of a few
dozen, request ids of ~50 characters, a few thousand requests per step."""

from __future__ import annotations

MAX_TP_SIZE = 256  # ranks of one engine (params' tp_size; a loader opens one socket per rank)
MAX_ID_CHARS = 512  # request ids, engine ids, pair keys, host names, agent names
MAX_REQUESTS = 65_536  # request ids in one message
MAX_MESSAGE_BYTES = 64 << 20  # one side-channel frame (a larger one drops its connection)
MAX_LAYERS = 4096
MAX_HEADS = 65_536
MAX_TOKENS = 1 << 31  # tokens of one request, one call or one chunk
MAX_WAIT_S = 60.0  # a long-polled grant, a peer's declared timeout: at most this (seconds)
MAX_CALLS = 65_536  # ops calls in one send request
MAX_LEASE_S = 365 * 86400.0  # a lease's end is published in int64 nanoseconds; no loader needs a year
