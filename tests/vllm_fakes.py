"""Fakes of the vLLM objects the connector reads (config, requests, block lists, cache tensors),
and the cache layouts as vLLM 0.32/0.33 kernels read them, for the tier-1 tests (no vLLM).

The CPU_ATTN page layout of ISA ``vec`` (``csrc/cpu/cpu_attn_vec.hpp``: per (block, head) page,
K ``[head_size, block_size]``, then V ``[block_size, head_size]``) is written and read by
:func:`cpu_vec_write` / :func:`cpu_vec_read` (``tests/test_vllm_layout.py`` checks them against
vLLM's own ``cpu_attn_reshape_and_cache`` where vLLM is installed)."""

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
    """What ``ConnectorConfig.from_vllm`` reads of a ``VllmConfig`` (the side channel on
    loopback unless ``extra`` names another host)."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            engine_id=engine_id,
            kv_role=role,
            kv_port=port,
            kv_connector_extra_config={"host": "127.0.0.1", **(extra or {})},
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


def cpu_vec_write(t: torch.Tensor, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Write tokens' K and V ``[T, H, d]`` into a CPU_ATTN layer as ISA ``vec`` stores them: in the
    (block, head) page, K of token t dim i at ``i * N + t``, V at ``N * d + t * d + i``."""
    b, h, n, c = t.shape
    d = c // 2
    pages = t.view(b, h, 2 * n * d)
    for tok in range(k.shape[0]):
        blk, off = block_ids[tok // n], tok % n
        pages[blk, :, off : n * d : n] = k[tok]
        pages[blk, :, n * d + off * d : n * d + (off + 1) * d] = v[tok]


def cpu_vec_read(t: torch.Tensor, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens' (K, V) ``[T, H, d]`` as ISA ``vec``'s kernels read a CPU_ATTN layer."""
    b, h, n, c = t.shape
    d = c // 2
    pages = t.view(b, h, 2 * n * d)
    ks, vs = [], []
    for tok in range(num_tokens):
        blk, off = block_ids[tok // n], tok % n
        ks.append(pages[blk, :, off : n * d : n])
        vs.append(pages[blk, :, n * d + off * d : n * d + (off + 1) * d])
    return torch.stack(ks), torch.stack(vs)


def token_rows(kv: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Rows [T, H, d] of a kernel view [B, N, H, d] for a request's block table."""
    n = kv.shape[1]
    t = torch.arange(num_tokens)
    return kv[torch.tensor(block_ids)[t // n], t % n]
