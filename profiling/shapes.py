"""Model shapes the benchmarks sweep: real configurations, one TP rank's cache each.

Numbers come from each model's Hugging Face ``config.json``:
head_dim = ``hidden_size / num_attention_heads``; kv heads = ``num_key_value_heads``;
layers = ``num_hidden_layers``; MLA latent = ``kv_lora_rank + qk_rope_head_dim``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvxfer import KVCacheSpec, Layout


@dataclass(frozen=True)
class ModelShape:
    """One rank's cache of a real model, and the head slice a transfer moves from it.

    ``slice_heads`` (default: all heads on the rank) and ``slice_start`` model a TP-mismatch
    read that takes only some heads of the rank, e.g. one 128-dim bf16 head = 256-byte runs.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp: int = 1
    use_mla: bool = False
    slice_start: int = 0
    slice_heads: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        spec = self.spec(Layout.NHD, 16, torch.bfloat16)  # raises on a bad shape
        heads = spec.heads_per_rank(self.tp)
        n = heads - self.slice_start if self.slice_heads is None else self.slice_heads
        if self.slice_start < 0 or n < 1 or self.slice_start + n > heads:
            raise ValueError(f"{self.name}: head slice [{self.slice_start}, +{n}) not within {heads} heads")

    def spec(self, layout: Layout | str, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            dtype=dtype,
            layout=Layout(layout) if not self.use_mla else Layout.NHD,
            use_mla=self.use_mla,
        )

    def heads_on_rank(self) -> int:
        return 1 if self.use_mla else max(1, self.num_kv_heads // self.tp)

    def moved_heads(self) -> int:
        """Heads one transfer moves from this rank."""
        return self.heads_on_rank() - self.slice_start if self.slice_heads is None else self.slice_heads

    def bytes_per_token(self, element_size: int = 2) -> int:
        """Wire bytes per token of one transfer from this rank."""
        return (
            self.num_layers * (1 if self.use_mla else 2) * self.moved_heads() * self.head_dim * element_size
        )

    def layouts(self, wanted: list[str]) -> list[str]:
        """The layouts to sweep: MLA has exactly one."""
        return ["MLA"] if self.use_mla else wanted


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape(
            "llama3-8b",
            32,
            8,
            128,
            source="meta-llama/Meta-Llama-3-8B config.json: num_hidden_layers=32, "
            "num_key_value_heads=8, hidden_size=4096 / num_attention_heads=32",
        ),
        ModelShape(
            "llama3-70b-tp8",
            80,
            8,
            128,
            tp=8,
            source="meta-llama/Meta-Llama-3-70B config.json: num_hidden_layers=80, "
            "num_key_value_heads=8, hidden_size=8192 / num_attention_heads=64; TP 8 -> 1 kv head/rank",
        ),
        ModelShape(
            "qwen2.5-7b",
            28,
            4,
            128,
            source="Qwen/Qwen2.5-7B config.json: num_hidden_layers=28, num_key_value_heads=4, "
            "hidden_size=3584 / num_attention_heads=28",
        ),
        ModelShape(
            "deepseek-v3-mla",
            61,
            1,
            576,
            use_mla=True,
            source="deepseek-ai/DeepSeek-V3 config.json: num_hidden_layers=61, kv_lora_rank=512 + "
            "qk_rope_head_dim=64",
        ),
        ModelShape(
            "llama3-8b-1head",
            32,
            8,
            128,
            slice_start=3,
            slice_heads=1,
            source="llama3-8b rank cache (8 heads), one head moved (a TP 1 -> TP 8 read): 256-byte runs",
        ),
    )
}
