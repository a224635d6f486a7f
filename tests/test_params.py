import dataclasses
import hashlib
import json

import pytest

from kvxfer import KVTransferParams, idops
from kvxfer.limits import MAX_ID_CHARS
from kvxfer.params import FIELD_LIMITS, params_dict

GOOD = {
    "request_id": "r1",
    "engine_id": "P",
    "host": "10.0.0.1",
    "port": 5000,
    "tp_size": 2,
    "block_ids": [3, 1, 4],
    "num_tokens": 40,
    "token": "0123456789abcdef" * 3,
    "version": 3,
}


def test_roundtrip_is_json_safe():
    p = KVTransferParams.from_dict(GOOD)
    d = p.to_dict()
    assert d == GOOD
    assert KVTransferParams.from_dict(json.loads(json.dumps(d))) == p


def test_list_for_parallel_sampling():
    kids = [{**GOOD, "request_id": f"r1-{i}"} for i in range(3)]
    out = KVTransferParams.from_dict(kids)
    assert [k.request_id for k in out] == ["r1-0", "r1-1", "r1-2"]
    with pytest.raises(ValueError, match=r"params\[1\]\.num_tokens"):
        KVTransferParams.from_dict([GOOD, {**GOOD, "num_tokens": -1}])
    with pytest.raises(ValueError, match="must not be empty"):
        KVTransferParams.from_dict([])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("request_id", ""),
        ("request_id", 5),
        ("engine_id", None),
        ("host", ""),
        ("port", 0),
        ("port", 70000),
        ("port", "5000"),
        ("port", True),
        ("tp_size", 0),
        ("num_tokens", 0),
        ("num_tokens", 1.5),
        ("block_ids", []),
        ("block_ids", "1,2"),
        ("block_ids", [1, -1]),
        ("block_ids", [1, 2.0]),
        ("version", 99),
        ("version", 1),  # params of a kvxfer without tokens
        ("token", ""),
        ("token", None),
        ("token", "short"),
    ],
)
def test_bad_field_named(field, value):
    with pytest.raises(ValueError, match=field):
        KVTransferParams.from_dict({**GOOD, field: value})


def test_missing_field_named():
    for field in ("request_id", "engine_id", "host", "port", "tp_size", "block_ids", "num_tokens", "token"):
        d = dict(GOOD)
        del d[field]
        with pytest.raises(ValueError, match=field):
            KVTransferParams.from_dict(d)
    with pytest.raises(ValueError, match="params"):
        KVTransferParams.from_dict("not a dict")


@pytest.mark.parametrize("ids", [[1, True], [False, 3], [2, 2**70], [3, None], [1.0]])
def test_block_ids_must_be_non_negative_ints(ids):
    with pytest.raises(ValueError, match="block_ids"):
        KVTransferParams.from_dict({**GOOD, "block_ids": ids})


def test_block_id_array_cached_and_read_only():
    p = KVTransferParams.from_dict(GOOD)
    a = p.block_id_array()
    assert a.tolist() == GOOD["block_ids"] and a is p.block_id_array()
    with pytest.raises(ValueError):
        a[0] = 7
    q = KVTransferParams(
        "r1", "P", "10.0.0.1", 5000, 2, (3, 1, 4), 40, GOOD["token"]
    )  # built without from_dict
    assert q.block_id_array().tolist() == [3, 1, 4] and q == p


@pytest.mark.parametrize(
    "d",
    [
        GOOD,
        {k: v for k, v in GOOD.items() if k != "version"},  # version defaults
        {**GOOD, "block_ids": [0, 1, 2**63 + 5]},  # range is the engine's check, not the params'
        {**GOOD, "extra": "ignored"},
    ],
)
def test_one_call_check_and_field_checks_agree(d):
    """The msgspec check (lists) and the field-by-field checks (tuples) build equal params."""
    fast = KVTransferParams.from_dict(d)
    slow = KVTransferParams.from_dict({**d, "block_ids": tuple(d["block_ids"])})
    assert fast == slow
    assert fast.block_id_array().tolist() == slow.block_id_array().tolist() == list(d["block_ids"])
    assert not fast.block_id_array().flags.writeable


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([1, True], "got a bool"),
        ([1, -2], "non-negative"),
        ([1, 2.0], "non-negative"),
        ([2**64], "non-negative"),
    ],
)
def test_one_call_check_failures_are_named_by_the_field_checks(ids, match):
    with pytest.raises(ValueError, match=f"block_ids: .*{match}"):
        KVTransferParams.from_dict({**GOOD, "block_ids": ids})


def test_params_from_a_dict_equal_those_made_by_the_constructor():
    """from_dict builds the frozen dataclass without its __init__ (a hot path): the result must
    be the same object in every way a caller sees."""
    d = params_dict("req-1", "eng", "10.0.0.2", 5600, 2, [7, 3, 9], 40, "f" * 48)
    got = KVTransferParams.from_dict(d)
    made = KVTransferParams("req-1", "eng", "10.0.0.2", 5600, 2, (7, 3, 9), 40, "f" * 48)
    assert got == made and hash(got) == hash(made) and repr(got) == repr(made)
    assert dataclasses.asdict(got) == dataclasses.asdict(made)
    assert got.to_dict() == d
    arr = got.block_id_array()
    assert arr.tolist() == [7, 3, 9] and not arr.flags.writeable
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.num_tokens = 1


class _Str(str):
    pass


class _Int(int):
    pass


_EDGES = [
    GOOD,
    {k: v for k, v in GOOD.items() if k != "version"},
    {**GOOD, "extra": "ignored"},
    {**GOOD, 7: "a key that is no str"},
    {**GOOD, "port": True},
    {**GOOD, "port": _Int(5000)},
    {**GOOD, "port": 65535, "tp_size": 2},
    {**GOOD, "port": 65534, "tp_size": 2},
    {**GOOD, "tp_size": 257},
    {**GOOD, "num_tokens": 2**31},
    {**GOOD, "request_id": _Str("r1")},
    {**GOOD, "request_id": "é" * MAX_ID_CHARS},
    {**GOOD, "request_id": "x" * (MAX_ID_CHARS + 1)},
    {**GOOD, "token": "0123456789abcdef" * 3 + "0"},
    {**GOOD, "version": 2},
    {**GOOD, "version": True},
    {**GOOD, "groups": None},
    {**GOOD, "groups": [2, 1]},
    {**GOOD, "block_ids": (3, 1, 4)},
    {**GOOD, "block_ids": []},
    {**GOOD, "block_ids": [3, -1]},
    {**GOOD, "block_ids": [3, True]},
    {**GOOD, "block_ids": [3, _Int(4)]},
    {**GOOD, "block_ids": [2**30, 2**40, 2**63 - 2]},
    {**GOOD, "block_ids": [2**63 - 1]},
    {**GOOD, "block_ids": [2**63 + 5]},
]


@pytest.mark.parametrize("d", _EDGES, ids=range(len(_EDGES)))
def test_the_native_check_takes_only_what_the_python_checks_accept_alike(d, monkeypatch):
    """The native module's one-call check (csrc/ctl/params_fields.h) either leaves a dict to the
    Python checks (None) or gives exactly the params they build from it: never params they
    refuse, never other ones. It takes the plain case itself."""
    assert idops.ensure(), idops.status()
    got = idops.params_fields(d, FIELD_LIMITS)
    monkeypatch.setattr(idops, "params_fields", idops.NUMPY["params_fields"])
    try:
        want = KVTransferParams.from_dict(d)
    except ValueError:
        assert got is None, d
        return
    if got is not None:
        fields, raw, digest = got
        assert fields == {f.name: getattr(want, f.name) for f in dataclasses.fields(want)}
        assert raw == want.block_id_array().tobytes()
        # the content digest (kvxfer.auth's module doc), as hashlib makes it from the same ids
        ids = want.block_id_array().tolist()
        width = 4 if max(ids) < 2**32 else 8
        head = want.num_tokens.to_bytes(8, "little") + bytes(5) + bytes([width])
        body = b"".join(x.to_bytes(width, "little") for x in ids)
        assert digest == want.digest() == hashlib.blake2b(head + body, digest_size=16).digest()
    if d is GOOD or d == {k: v for k, v in GOOD.items() if k != "version"}:
        assert got is not None  # the common case is taken natively
    monkeypatch.undo()
    native = KVTransferParams.from_dict(d)
    assert native == want and native.block_id_array().tolist() == want.block_id_array().tolist()
    assert not native.block_id_array().flags.writeable
