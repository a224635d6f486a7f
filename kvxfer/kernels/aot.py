"""Ahead-of-time compilation of the move kernel for a CUDA target, without a GPU.

CI has no GPU, so it compiles the kernel for sm_90a (and sm_80) with ``triton.compile`` and
inspects the PTX, e.g. that an aligned bf16 gather moves 128-bit words. Must run in a process
where ``TRITON_INTERPRET`` is unset (interpreted kernels cannot be compiled); the tests run
``python -m kvxfer.kernels.aot`` in a subprocess for that reason.

    python -m kvxfer.kernels.aot --arch 90 --dtype bfloat16 --head-dim 128 [--misalign 0] [--persistent]

prints a JSON object ``{"gather": ptx, "scatter": ptx, "copy": ptx}``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .launch import _GPU_BUDGET_NUM_WARPS, INTERPRETED, Plan
from .rows import move_rows_kernel

__all__ = ["OPS", "compile_ptx", "nhd_plan"]

OPS = {"gather": (True, False), "scatter": (False, True), "copy": (True, True)}
_INT_ARGS = ("T", "L", "KV", "num_t_tiles", "num_tiles")
_SIDE_INTS = ("head_start", "bs", "sb", "s_kv", "s_blk", "s_tok", "s_head")


def compile_ptx(op: str, plan: Plan, arch: int = 90, persistent: bool = False) -> str:
    """PTX of the kernel ``op`` ("gather", "scatter" or "copy") would launch with ``plan``;
    ``persistent``: the variant launched under an SM budget (a capped grid striding over the
    tiles, with the budget's warps).

    Pointer arguments are declared 16-byte aligned only when ``plan.align`` is 16 (as Triton
    specialises them at run time); integer arguments are left unspecialised, so vector widths
    come from the kernel's own alignment hints alone.
    """
    if INTERPRETED:
        raise RuntimeError("kvxfer.kernels.aot: unset TRITON_INTERPRET to compile kernels")
    src_paged, dst_paged = OPS[op]
    word = "i" + str(8 * plan.word_bytes) if plan.word_bytes > 1 else "u8"
    sig: dict[str, str] = {}
    for side, paged in (("src", src_paged), ("dst", dst_paged)):
        sig[side] = "*i64" if paged else f"*{word}"
        sig[f"{side}_ids"] = "*i32" if paged else f"*{word}"
    sig.update({name: "i32" for name in _INT_ARGS})
    for side in ("src", "dst"):
        sig.update({f"{side}_{name}": "i64" if name.startswith("s_") else "i32" for name in _SIDE_INTS})
    constexprs = plan.constexprs(src_paged, dst_paged)
    constexprs["PERSISTENT"] = persistent
    sig.update({k: "constexpr" for k in constexprs})
    names = list(sig)
    attrs = {}
    if plan.align == 16:
        attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items() if v.startswith("*")}
    src = ASTSource(move_rows_kernel, sig, constexprs=constexprs, attrs=attrs)
    num_warps = _GPU_BUDGET_NUM_WARPS if persistent else plan.num_warps
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    return kernel.asm["ptx"]


def nhd_plan(dtype: torch.dtype, head_dim: int, misalign: int = 0, num_tokens: int = 4096) -> Plan:
    """The GPU plan of a Llama-8B-like NHD cache (8 kv heads, 16-token blocks, 1024 blocks).

    ``misalign`` shifts the caches' base address by that many bytes (a negative control: the
    words and vectors must narrow).
    """
    es = torch.empty((), dtype=dtype).element_size()
    row = head_dim * es
    values = [2 * 1024 * 16 * 8 * row, 16 * 8 * row, 8 * row, row, 256 + misalign]
    return Plan(row, values, num_tokens, interpreted=False)


def _main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--misalign", type=int, default=0, help="byte offset of the caches' base")
    ap.add_argument("--persistent", action="store_true", help="the variant launched under an SM budget")
    args = ap.parse_args(argv)
    plan = nhd_plan(getattr(torch, args.dtype), args.head_dim, args.misalign)
    json.dump({op: compile_ptx(op, plan, args.arch, args.persistent) for op in OPS}, sys.stdout)


if __name__ == "__main__":
    _main(sys.argv[1:])
