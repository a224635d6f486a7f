"""``Planner.check``: a batch's params checked against the peer before any lease is asked —
ids as many as the exporter's block size needs and in its range, no params twice — each refusal
naming its load and why, the others passed on with what their lease request carries."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from kvxfer.auth import EngineSecret, content_digest
from kvxfer.engine_types import LoadItem
from kvxfer.params import KVTransferParams, params_dict
from kvxfer.planner import Planner
from kvxfer.spec import KVCacheSpec

SPEC = KVCacheSpec(2, 4, 16, 16, torch.float16)
SECRET = EngineSecret("P", 0, 0)


def item(rid: str, prid: str, ids: list[int], num_tokens: int) -> LoadItem:
    token = SECRET.token(prid, bytes(8), content_digest(num_tokens, np.array(ids, dtype=np.int64)))
    p = KVTransferParams.from_dict(params_dict(prid, "P", "127.0.0.1", 5555, 1, ids, num_tokens, token))
    return LoadItem(rid, p, np.arange(len(ids), dtype=np.int64))


def test_check_passes_what_fits_and_names_each_refusal():
    planner = Planner(SimpleNamespace(groups=None), None)
    peer = SimpleNamespace(spec=SPEC, num_blocks=10)
    items = [
        item("a", "pa", [1, 2], 20),  # fits
        item("b", "pb", [1, 2, 3], 20),  # one id too many for 20 tokens of 16
        item("c", "pc", [4, 10], 20),  # 10 is out of the exporter's range
        item("d", "pa", [5, 6], 20),  # the params of "a" again
        item("e", "pe", [7], 3),  # fits
    ]
    good, rids, toks, digests, bad = planner.check(peer, items)
    assert [it.request_id for it in good] == ["a", "e"] and rids == ["pa", "pe"]
    assert toks == [items[0].params.token, items[4].params.token]
    assert digests == [items[0].params.digest(), items[4].params.digest()]
    assert [(it.request_id, why) for it, why in bad] == [
        ("b", "params.block_ids: has 3 ids, num_tokens needs 2"),
        ("c", "params.block_ids: out of the exporter's range [0, 10)"),
        ("d", "params.request_id: 'pa' is loaded twice in one batch"),
    ]
