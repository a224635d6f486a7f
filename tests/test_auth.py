"""Tokens: one export's capability. The token is keyed BLAKE2b of the request id, the export's
nonce and its content digest, and nothing else verifies. Every test runs twice: through the
native module's hashes (csrc/ctl/token_hash.h) and through hashlib (the module not loaded)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvxfer import auth, idops
from kvxfer.auth import TOKEN_CHARS, EngineSecret, content_digest, request_token

_NATIVE = auth._native  # before the fixture replaces it (the hashlib runs)


@pytest.fixture(autouse=True, params=["native", "hashlib"])
def path(request, monkeypatch):
    """The hashes through the native module, or through hashlib (the module not loaded)."""
    if request.param == "native":
        assert idops.ensure(), idops.status()  # a compiler is there (tests/test_idops.py says so too)
        assert _NATIVE() is not None
    else:
        monkeypatch.setattr(auth, "_native", lambda: None)
    return request.param


def _want_digest(num_tokens: int, ids, groups=None) -> bytes:
    """The content digest as the module doc defines it, written out here with ints and hashlib:
    a 14-byte header (num_tokens, grouped, number of groups, the ids' width), the groups, the ids."""
    width = 4 if all(int(x) < 2**32 for x in ids) else 8
    head = num_tokens.to_bytes(8, "little") + bytes([groups is not None])
    head += (len(groups) if groups is not None else 0).to_bytes(4, "little") + bytes([width])
    body = b"".join(int(g).to_bytes(8, "little") for g in groups or ())
    body += b"".join(int(x).to_bytes(width, "little") for x in ids)
    return hashlib.blake2b(head + body, digest_size=16).digest()


def _want_token(key: bytes, rid: str, nonce: bytes, digest: bytes) -> str:
    """The token as the module doc defines it, written out here with hashlib."""
    mac = hashlib.blake2b(rid.encode() + b"\0" + nonce + digest, key=key, digest_size=16).digest()
    return nonce.hex() + mac.hex()


@pytest.mark.parametrize("key_len", [1, 31, 32, 63, 64])
# MAC inputs of 26, 41, 128 (one block after the key's), 129 and 324 bytes
@pytest.mark.parametrize("rid", ["r", "req-0001/child-3", "x" * 103, "x" * 104, "ünïcødé-ид" * 20])
def test_token_is_keyed_blake2b_of_the_request_nonce_and_digest(key_len, rid):
    key = bytes((7 * i + key_len) % 256 for i in range(key_len))
    nonce = bytes(range(3, 11))
    dg = content_digest(7, np.arange(5, dtype=np.int64))
    tok = request_token(key, rid, nonce, dg)
    assert tok == _want_token(key, rid, nonce, dg) and len(tok) == TOKEN_CHARS
    assert request_token(key[:-1] + bytes([key[-1] ^ 1]), rid, nonce, dg) != tok  # one key bit


def test_native_and_hashlib_give_the_same_token_and_digest(path):
    """The two paths on one input: a token made by a process with the module verifies in one
    without it (vLLM's scheduler may run either)."""
    ids = np.random.default_rng(3).choice(10**6, 300, replace=False).astype(np.int64)
    key = bytes(range(32))
    for groups in (None, [100, 200], [0, 300]):
        dg = content_digest(4000, ids, groups)
        tok = request_token(key, "q", bytes(8), dg)
        auth_native = _NATIVE()
        if path == "native":  # the other path's result on the same bytes
            assert dg == _want_digest(4000, ids, groups)
            assert tok == _want_token(key, "q", bytes(8), dg)
        else:
            assert auth_native is not None
            assert dg == auth_native.content_digest(4000, ids, None if groups is None else np.asarray(groups))
            assert tok == auth_native.token(key, "q", bytes(8), dg)


@pytest.mark.parametrize("groups", [None, [100, 200], [0, 300]])
@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_export_token_is_the_token_of_the_content_digest(groups, dtype):
    """An export's (token, digest) in one call: the digest of its ids (int64 or uint64, a
    strided view too) and the token of that digest, as the two calls make them."""
    ids = np.random.default_rng(4).choice(10**6, 600, replace=False).astype(dtype)
    key = bytes(range(1, 33))
    nonce = (9).to_bytes(8, "big")
    for arr in (ids[:300], ids[::2]):
        tok, dg = auth.export_token(key, "r-7", nonce, 4000, arr, groups)
        assert dg == content_digest(4000, np.ascontiguousarray(arr), groups)
        assert tok == _want_token(key, "r-7", nonce, dg)
        s = EngineSecret("E", 0, 0)
        assert s.export_token("r-7", nonce, 4000, arr, groups) == (s.token("r-7", nonce, dg), dg)


def test_native_export_token_refuses_bad_arguments_by_name():
    mod = _NATIVE()
    assert mod is not None
    ids = np.arange(3, dtype=np.int64)
    with pytest.raises(ValueError, match="key must be 1 to 64 bytes"):
        mod.export_token(b"", "q", bytes(8), 5, ids, None)
    with pytest.raises(ValueError, match="nonce must be 8 bytes"):
        mod.export_token(bytes(32), "q", bytes(7), 5, ids, None)
    with pytest.raises(TypeError, match="request_id must be str"):
        mod.export_token(bytes(32), b"q", bytes(8), 5, ids, None)
    with pytest.raises(TypeError, match="ids: must hold 8-byte ints"):
        mod.export_token(bytes(32), "q", bytes(8), 5, ids.astype(np.int32), None)
    with pytest.raises(ValueError, match="export_token: num_tokens"):
        mod.export_token(bytes(32), "q", bytes(8), -1, ids, None)


def test_native_token_refuses_bad_arguments_by_name():
    mod = _NATIVE()
    assert mod is not None
    dg = bytes(16)
    with pytest.raises(ValueError, match="key must be 1 to 64 bytes"):
        mod.token(b"", "q", bytes(8), dg)
    with pytest.raises(ValueError, match="key must be 1 to 64 bytes"):
        mod.token(bytes(65), "q", bytes(8), dg)
    with pytest.raises(ValueError, match="nonce must be 8 bytes"):
        mod.token(bytes(32), "q", bytes(7), dg)
    with pytest.raises(TypeError, match="request_id must be str"):
        mod.token(bytes(32), b"q", bytes(8), dg)
    with pytest.raises(ValueError):  # a lone surrogate has no UTF-8
        mod.token(bytes(32), "q\ud800", bytes(8), dg)
    with pytest.raises(TypeError, match="ids: must hold 8-byte ints"):
        mod.content_digest(5, np.arange(3, dtype=np.int32), None)
    with pytest.raises(ValueError, match="num_tokens"):
        mod.content_digest(-1, np.arange(3), None)


def test_engine_secret_token_is_request_token_of_its_secret():
    dg = content_digest(12, np.array([3, 4], dtype=np.int64))
    for s in (EngineSecret("E", 0, 0), EngineSecret("E", 0, 0, auth_key="cluster")):
        nonce = (5).to_bytes(8, "big")
        tok = s.token("q", nonce, dg)
        assert tok == request_token(s.secret, "q", nonce, dg) and len(tok) == TOKEN_CHARS
        assert tok[:16] == nonce.hex()
        assert s.verify("q", tok, dg)


def test_a_token_opens_its_request_nonce_and_content_only():
    s = EngineSecret("E", 0, 0)
    ids = np.array([3, 4, 9], dtype=np.int64)
    dg = content_digest(40, ids)
    tok = s.token("q", bytes(8), dg)
    assert s.token("q", (1).to_bytes(8, "big"), dg) != tok  # another export of the same id
    assert not s.verify("q2", tok, dg)  # another request id
    assert not s.verify("q", tok, content_digest(40, np.array([3, 4, 10])))  # other blocks
    assert not s.verify("q", tok, content_digest(39, ids))  # other token count
    assert not s.verify("q", tok[:-1] + ("0" if tok[-1] != "0" else "1"), dg)  # one character off
    assert not s.verify("q", "zz" + tok[2:], dg)  # not hex
    assert not s.verify("q", tok, None) and not s.verify("q", 7, dg) and not s.verify("q", tok[:32], dg)
    assert not EngineSecret("E", 0, 0).verify("q", tok, dg)  # another engine start (secret)
    made = s.new_token("q", 40, [3, 4, 9])
    assert s.verify("q", made, dg) and made != s.new_token("q", 40, [3, 4, 9])  # random nonces


def test_content_digest_reads_uint64_and_int64_alike_and_every_id():
    a = np.array([0, 7, 2**40], dtype=np.int64)
    assert content_digest(5, a) == content_digest(5, a.view(np.uint64))
    assert content_digest(5, a) != content_digest(5, a[::-1].copy())
    assert content_digest(5, a) != content_digest(6, a)
    assert len(content_digest(5, a)) == 16


# 14 + 4 * num_ids bytes (8 per id from 2**32 on): one block at 28 ids, just over at 29; packed 256
# ids a pass; the native digest lets other threads run from 8192 ids
@pytest.mark.parametrize("num_ids", [1, 4, 15, 16, 17, 28, 29, 255, 256, 257, 1000, 8192])
@pytest.mark.parametrize("big", [False, True], ids=["4-byte ids", "an id of 2**40"])
def test_content_digest_is_blake2b_of_little_endian_bytes_whatever_the_array(num_ids, big):
    """The digest's input is fixed (the header, then the ids little-endian at their width),
    whether the ids come contiguous (hashed as they are, in updates under 2 KiB), strided,
    big-endian or narrower."""
    a = np.random.default_rng(num_ids).choice(2**31, num_ids, replace=False).astype(np.int64)
    if big:
        a[0] = 2**40
    want = _want_digest(5, a.tolist())
    wide = np.zeros(2 * num_ids, dtype=np.int64)
    wide[::2] = a
    for ids in (a, a.view(np.uint64), wide[::2], a.astype(">i8")):
        assert content_digest(5, ids) == want, ids.dtype
    assert content_digest(5, a[:-1]) != want and content_digest(6, a) != want
    small = a[1:3]
    assert content_digest(5, small.astype(np.int32)) == content_digest(5, small)


def test_the_header_keeps_apart_what_the_bytes_alone_would_not():
    """Inputs whose ids' bytes could read alike: one id of 2**32 + 7 (8 bytes) and the ids 7, 1
    (4 bytes each); one group of the ids and none; the groups' counts moved between groups."""
    assert content_digest(5, np.array([2**32 + 7])) != content_digest(5, np.array([7, 1]))
    ids = np.array([3, 4, 5])
    assert content_digest(5, ids, [3]) != content_digest(5, ids)
    assert content_digest(5, ids, [1, 2]) != content_digest(5, ids, [2, 1])
