"""Fakes of the vLLM objects the connector reads (config, requests, block lists, cache tensors),
and the cache layouts as vLLM 0.32/0.33 kernels read them, for the tier-1 tests (no vLLM)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch


class Status(enum.Enum):
    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5


def vllm_config(
    role="kv_both", port=15000, tp=1, block_size=16, engine_id="E", dp_rank=0, dp_size=1, extra=None, **par
):
    """What ``ConnectorConfig.from_vllm`` reads of a ``VllmConfig``."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            engine_id=engine_id,
            kv_role=role,
            kv_ip="127.0.0.1",
            kv_port=port,
            kv_connector_extra_config=dict(extra or {}),
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp,
            pipeline_parallel_size=par.get("pp", 1),
            data_parallel_size=dp_size,
            data_parallel_index=dp_rank,
            decode_context_parallel_size=par.get("dcp", 1),
            prefill_context_parallel_size=1,
        ),
        cache_config=SimpleNamespace(block_size=block_size),
    )


@dataclass
class Request:
    """The attributes of ``vllm.v1.request.Request`` the connector reads."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict | None = None
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class Blocks:
    """``KVCacheBlocks`` as far as ``get_block_ids()`` goes (one group)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = list(ids)

    def get_block_ids(self):
        return (list(self.ids),)


# ------------------------------------------------------------------ vLLM cache tensors
def fa_cache(num_blocks: int, heads: int, block_size: int, head_size: int, dtype, physical="LBNHC"):
    """A FlashAttention-style layer: logical [B, H, N, 2d] over memory in ``physical`` order
    (LBNHC: [B, N, H, C]; LBHNC: [B, H, N, C])."""
    c = 2 * head_size
    if physical == "LBNHC":
        return torch.zeros(num_blocks, block_size, heads, c, dtype=dtype).transpose(1, 2)
    return torch.zeros(num_blocks, heads, block_size, c, dtype=dtype)


def cpu_cache(num_blocks: int, heads: int, block_size: int, head_size: int, dtype):
    """A CPU_ATTN layer: [B, H, N, 2d], contiguous (LBHNC)."""
    return torch.zeros(num_blocks, heads, block_size, 2 * head_size, dtype=dtype)


def fa_kernel_kv(t: torch.Tensor, head_size: int):
    """How FlashAttention/FlashInfer/Triton read a layer: (K, V) each [B, N, H, d]."""
    return t.transpose(1, 2).split(head_size, dim=-1)


def cpu_kernel_kv(t: torch.Tensor):
    """How CPU_ATTN reads a layer (``view`` to [B, H, 2N, d], ``chunk`` at dim 2): (K, V) each
    [B, H, N, d]; returned as [B, N, H, d] to compare with :func:`fa_kernel_kv`."""
    b, h, n, c = t.shape
    k, v = t.view(b, h, 2 * n, c // 2).chunk(2, dim=2)
    return k.transpose(1, 2), v.transpose(1, 2)


def token_rows(kv: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Rows [T, H, d] of a kernel view [B, N, H, d] for a request's block table."""
    n = kv.shape[1]
    t = torch.arange(num_tokens)
    return kv[torch.tensor(block_ids)[t // n], t % n]
