"""Tokens: one export's capability. The precomputed-state HMAC gives hmac's bytes; a token binds
the request id, the export's nonce and its content digest, and nothing else verifies."""

from __future__ import annotations

import hashlib
import hmac

import numpy as np
import pytest

from kvxfer.auth import TOKEN_CHARS, EngineSecret, _KeyedSha256, content_digest, request_token


@pytest.mark.parametrize("key_len", [0, 1, 31, 32, 63, 64, 65, 200])
@pytest.mark.parametrize("data", [b"r", b"req-0001/child-3\0" + bytes(24), "ünïcødé-ид".encode(), b"x" * 500])
def test_keyed_state_mac_is_hmac_sha256(key_len, data):
    key = bytes((7 * i + key_len) % 256 for i in range(key_len))
    want = hmac.new(key, data, hashlib.sha256).digest()
    k = _KeyedSha256(key)
    assert k.mac(data) == want
    assert k.mac(data) == want  # the kept states are copied, never consumed


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


@pytest.mark.parametrize("num_ids", [4, 255, 256, 1000])
def test_content_digest_is_blake2b_of_little_endian_bytes_whatever_the_array(num_ids):
    """The digest's input is fixed (8-byte little-endian count, then little-endian int64 ids),
    whether the ids come contiguous (hashed as they are, in updates of 255 ids), strided,
    big-endian or narrower."""
    a = np.random.default_rng(num_ids).choice(2**31, num_ids, replace=False).astype(np.int64)
    a[0] = 2**40
    want = hashlib.blake2b(
        (5).to_bytes(8, "little") + b"".join(int(x).to_bytes(8, "little") for x in a), digest_size=16
    ).digest()
    wide = np.zeros(2 * num_ids, dtype=np.int64)
    wide[::2] = a
    for ids in (a, a.view(np.uint64), wide[::2], a.astype(">i8")):
        assert content_digest(5, ids) == want, ids.dtype
    assert content_digest(5, a[:-1]) != want and content_digest(6, a) != want
    small = a[1:3]
    assert content_digest(5, small.astype(np.int32)) == content_digest(5, small)
