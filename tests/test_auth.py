"""Tokens: the precomputed-state HMAC of EngineSecret.token gives the bytes of request_token."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from kvxfer.auth import EngineSecret, _KeyedSha256, request_token


@pytest.mark.parametrize("key_len", [0, 1, 31, 32, 63, 64, 65, 200])
@pytest.mark.parametrize("rid", ["r", "req-0001/child-3", "ünïcødé-ид", "x" * 500])
def test_keyed_state_token_is_hmac_sha256(key_len, rid):
    key = bytes((7 * i + key_len) % 256 for i in range(key_len))
    want = hmac.new(key, rid.encode(), hashlib.sha256).digest()[:16].hex()
    assert request_token(key, rid) == want
    k = _KeyedSha256(key)
    assert k.token(rid) == want
    assert k.token(rid) == want  # the kept states are copied, never consumed


def test_engine_secret_token_is_request_token_of_its_secret():
    for s in (EngineSecret("E", 0, 0), EngineSecret("E", 0, 0, auth_key="cluster")):
        assert s.token("q") == request_token(s.secret, "q")
        assert s.token("q") != s.token("q2") and len(s.token("q")) == 32
