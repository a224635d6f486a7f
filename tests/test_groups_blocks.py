"""kvxfer.groups.blocks: a sliding-window group's in-window blocks on both sides (vLLM's null
block in the list, any two block sizes) and their token slots, moved exactly with the slot ops;
a state group's running state block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvxfer import KVCacheSpec, Layout
from kvxfer.groups import NULL_BLOCK, select_window_blocks, state_block, window_tokens
from kvxfer.ops import copy_blocks, register_caches
from tests import kvdata


def test_window_tokens():
    assert window_tokens(70, 32) == range(39, 70)
    assert window_tokens(70, 32, extra_retained_tokens=5) == range(34, 70)
    assert window_tokens(20, 32) == range(0, 20)
    assert window_tokens(0, 8) == range(0, 0)
    assert window_tokens(8, 1) == range(8, 8)  # a window of one token needs nothing cached
    with pytest.raises(ValueError, match="window: must be an int >= 1"):
        window_tokens(10, 0)
    with pytest.raises(ValueError, match="num_tokens: must be an int >= 0"):
        window_tokens(-1, 4)


def test_the_research_docs_example():
    """§2 [ran]: w=32, b=16, 70 tokens, after step 1 P's list is [0, 0, 3, 4, 5]: tokens 39..69
    live in positions 2..4."""
    got = select_window_blocks([0, 0, 3, 4, 5], [0, 0, 9, 8, 7, 6], 70, 32, 16, 16)
    assert (got.first_token, got.num_tokens, got.src_first_block, got.dst_first_block) == (39, 70, 2, 2)
    assert got.src_block_ids.tolist() == [3, 4, 5] and got.dst_block_ids.tolist() == [9, 8, 7]
    assert got.aligned_start == 32 and got.num_window_tokens == 31
    ids, n = got.src_aligned()
    assert ids.tolist() == [3, 4, 5] and n == 38
    assert got.src_slots().tolist() == [3 * 16 + 7 + k for k in range(9)] + [
        4 * 16 + k for k in range(16)
    ] + [5 * 16 + k for k in range(6)]


def test_block_sizes_differ():
    """P 16-token blocks, D 6-token blocks, 70 tokens, window 32: tokens 39..69; D's window starts
    at its position 6 (token 36); no token <= 39 starts a block on both sides past both lists'
    dead blocks (lcm 48 > 39, 0 is dead on P): slots only."""
    src = [0, 0, 3, 4, 5]
    dst = [0] * 6 + [20, 21, 22, 23, 24, 25]
    got = select_window_blocks(src, dst, 70, 32, 16, 6)
    assert got.dst_first_block == 6 and got.dst_block_ids.tolist() == [20, 21, 22, 23, 24, 25]
    assert got.aligned_start is None
    with pytest.raises(ValueError, match="move the window by token slots"):
        got.dst_aligned()
    t = np.arange(39, 70)
    assert got.dst_slots().tolist() == (np.array(dst)[t // 6] * 6 + t % 6).tolist()
    assert got.src_slots().tolist() == (np.array(src)[t // 16] * 16 + t % 16).tolist()
    # P 8, D 4: token 32 starts a block on both sides, real on both (D's position 8 holds
    # tokens 32..35, before the window but still the request's own)
    got = select_window_blocks([0] * 4 + [9, 8, 7, 6, 5], [0] * 8 + list(range(30, 40)), 70, 32, 8, 4)
    assert got.dst_first_block == 9 and got.dst_block_ids.tolist() == list(range(31, 40))
    assert got.aligned_start == 32 and got.src_aligned()[0].tolist() == [9, 8, 7, 6, 5]
    assert got.dst_aligned()[0].tolist() == list(range(30, 40)) and got.dst_aligned()[1] == 38
    # the same with D's position 8 freed (null): no aligned start
    got = select_window_blocks([0] * 4 + [9, 8, 7, 6, 5], [0] * 9 + list(range(31, 40)), 70, 32, 8, 4)
    assert got.aligned_start is None and got.dst_aligned_ids.size == 0


def test_refusals_name_side_and_position():
    with pytest.raises(
        ValueError, match=r"src_block_ids: position 2 holds the null block \(0\) but holds in-window"
    ):
        select_window_blocks([0, 0, 0, 4, 5], [1, 2, 3, 4, 5], 70, 32, 16, 16)
    with pytest.raises(ValueError, match="dst_block_ids: 70 tokens need 5 blocks of 16, the list has 4"):
        select_window_blocks([0, 0, 3, 4, 5], [0, 0, 3, 4], 70, 32, 16, 16)
    with pytest.raises(ValueError, match="dst_block_ids: repeated block id 3 among the in-window blocks"):
        select_window_blocks([0, 0, 3, 4, 5], [0, 0, 3, 3, 6], 70, 32, 16, 16)
    with pytest.raises(ValueError, match="src_block_ids: negative block id"):
        select_window_blocks([-1, 0, 3, 4, 5], [1, 2, 3, 4, 5], 70, 32, 16, 16)
    with pytest.raises(ValueError, match="src_block_ids: must hold integers"):
        select_window_blocks([1.0, 2.0], [1, 2], 20, 32, 16, 16)
    with pytest.raises(ValueError, match="dst_block_size: must be an int >= 1"):
        select_window_blocks([1, 2], [1, 2], 20, 32, 16, 0)
    # a list that uses no null id: 0 is a block like any other
    got = select_window_blocks([0, 1], [0, 1], 20, 32, 16, 16, null_block=None)
    assert got.src_block_ids.tolist() == [0, 1]


@pytest.mark.parametrize("src_bs,dst_bs", [(16, 16), (16, 6), (4, 16), (8, 12)])
def test_slots_move_exactly_the_window(src_bs, dst_bs):
    """Through the ops on token-slot registrations: D holds P's in-window tokens, every other
    byte of D stays poison, including its blocks' rows before the window."""
    spec_p = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=src_bs, dtype=torch.bfloat16)
    spec_d = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=dst_bs, dtype=torch.bfloat16,
                         layout=Layout.HND)  # fmt: skip
    num_tokens, window = 53, 20
    tokens = window_tokens(num_tokens, window)
    truth = kvdata.truth_bytes(spec_p, num_tokens)
    nb_p, nb_d = 64 // src_bs + 2, 64 // dst_bs + 2
    p_list = list(range(1, -(-num_tokens // src_bs) + 1))[::-1]
    p_list = [NULL_BLOCK if (i + 1) * src_bs <= tokens.start else b for i, b in enumerate(p_list)]
    d_list = [
        NULL_BLOCK if (i + 1) * dst_bs <= tokens.start else nb_d - 1 - i
        for i in range(-(-num_tokens // dst_bs))
    ]
    p = kvdata.empty_cache(spec_p, nb_p, 2)
    kvdata.place(p, spec_p, truth, range(2), [b if b else nb_p - 1 for b in p_list])  # dead blocks: scratch
    d = kvdata.empty_cache(spec_d, nb_d, 2)
    sel = select_window_blocks(p_list, d_list, num_tokens, window, src_bs, dst_bs)
    rp = register_caches(p, spec_p, token_slots=True)
    rd = register_caches(d, spec_d, token_slots=True)
    copy_blocks(rp, rp.spec, sel.src_slots(), rd, rd.spec, sel.dst_slots(), sel.num_window_tokens)
    want = kvdata.empty_cache(spec_d, nb_d, 2)
    t = torch.arange(tokens.start, num_tokens)
    for layer in range(2):
        view = kvdata._byte_view(want[layer], spec_d)
        blocks = torch.tensor(d_list)[t // dst_bs]
        for h in range(2):
            view[:, blocks, t % dst_bs, h] = truth[layer, :, h, tokens.start :]
    for g, w in zip(d, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def test_state_block():
    assert state_block([7]) == 7
    assert state_block([7, 8, 9], num_speculative_blocks=2) == 7
    assert state_block([0, 0, 0, 4]) == 4  # align mode: the block of the last computed token
    with pytest.raises(ValueError, match=r"the state block \(position 0\) is the null block"):
        state_block([0, 5], num_speculative_blocks=1)
    with pytest.raises(
        ValueError, match="block_ids: 1 entries, a state group's list holds its state block and 1"
    ):
        state_block([5], num_speculative_blocks=1)
    with pytest.raises(ValueError, match="num_speculative_blocks: must be an int >= 0"):
        state_block([5], num_speculative_blocks=-1)
