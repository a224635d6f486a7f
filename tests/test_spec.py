import pytest
import torch

from kvxfer import KVCacheSpec, Layout


def spec(**kw):
    base = dict(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    base.update(kw)
    return KVCacheSpec(**base)


@pytest.mark.parametrize(
    "tp,rank,heads",
    [
        (1, 0, range(0, 8)),
        (2, 1, range(4, 8)),
        (4, 3, range(6, 8)),
        (8, 5, range(5, 6)),
        (16, 5, range(2, 3)),
    ],
)
def test_heads_of_rank(tp, rank, heads):
    assert spec().heads_of_rank(rank, tp) == heads


def test_replicated_heads_follow_megatron():
    s = spec(num_kv_heads=2)
    assert [s.heads_of_rank(r, 4).start for r in range(4)] == [0, 0, 1, 1]
    assert [s.heads_of_rank(r, 8).start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_shapes():
    assert spec().cache_shape(10, 2) == (2, 10, 16, 4, 128)
    assert spec(layout=Layout.HND).cache_shape(10, 2) == (2, 10, 4, 16, 128)
    assert spec(num_kv_heads=2).cache_shape(3, 4) == (2, 3, 16, 1, 128)
    assert spec().wire_shape(100, 3) == (3, 4, 2, 100, 128)
    mla = spec(num_kv_heads=1, head_dim=576, use_mla=True)
    assert mla.cache_shape(10, 8) == (10, 16, 576)
    assert mla.wire_shape(100, 1) == (4, 100, 576)
    assert mla.heads_of_rank(7, 8) == range(0, 1)


def test_sizes():
    s = spec()
    assert s.element_size == 2
    assert s.bytes_per_token() == 8 * 4 * 2 * 128 * 2
    assert s.num_blocks_for(0) == 0 and s.num_blocks_for(16) == 1 and s.num_blocks_for(17) == 2


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": -1}, "num_kv_heads"),
        ({"head_dim": 1.5}, "head_dim"),
        ({"block_size": True}, "block_size"),
        ({"dtype": "bf16"}, "dtype"),
        ({"dtype": torch.complex64}, "dtype"),
        ({"layout": "NCHW"}, "layout"),
        ({"use_mla": 1}, "use_mla"),
        ({"use_mla": True}, "num_kv_heads"),
    ],
)
def test_invalid_spec_names_field(kw, field):
    with pytest.raises(ValueError, match=field):
        spec(**kw)


@pytest.mark.parametrize(
    "tp,rank,msg", [(3, 0, "tp_size"), (12, 0, "tp_size"), (4, 4, "tp_rank"), (2, -1, "tp_rank")]
)
def test_invalid_tp(tp, rank, msg):
    with pytest.raises(ValueError, match=msg):
        spec().heads_of_rank(rank, tp)


def test_roundtrip_dict_and_mismatch():
    s = spec(dtype=torch.float8_e4m3fn, layout="HND")
    assert s.layout is Layout.HND
    assert KVCacheSpec.from_dict(s.to_dict()) == s
    assert s.model_mismatch(spec(dtype=torch.float8_e4m3fn, block_size=32)) is None
    assert "head_dim" in s.model_mismatch(spec(dtype=torch.float8_e4m3fn, head_dim=64))
    assert "dtype" in s.model_mismatch(spec())
    with pytest.raises(ValueError, match="dtype"):
        KVCacheSpec.from_dict({**s.to_dict(), "dtype": "float7"})
    with pytest.raises(ValueError, match="block_size"):
        KVCacheSpec.from_dict({k: v for k, v in s.to_dict().items() if k != "block_size"})
