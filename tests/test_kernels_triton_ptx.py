"""Ahead-of-time compile of the Triton kernel for sm_90a / sm_80 (no GPU needed) and PTX checks.

The aligned bf16 gather, scatter and copy must move their data with 128-bit global loads and
stores, so a vectorisation regression fails CI. Compiling needs a process where
TRITON_INTERPRET is unset, so the compile runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, op, arch, dtype, head_dim, misalign)
CONFIGS = [
    ("aligned_bf16_gather_sm90", "gather", 90, "bfloat16", 128, 0),
    ("aligned_bf16_scatter_sm90", "scatter", 90, "bfloat16", 128, 0),
    ("aligned_bf16_copy_sm90", "copy", 90, "bfloat16", 128, 0),
    ("aligned_bf16_gather_sm80", "gather", 80, "bfloat16", 128, 0),
    ("odd_dim96_bf16_gather_sm90", "gather", 90, "bfloat16", 96, 0),
    ("fp8_gather_sm90", "gather", 90, "float8_e4m3fn", 128, 0),
    ("misaligned4_fp32_gather_sm90", "gather", 90, "float32", 128, 4),
]

_SCRIPT = """
import json, sys, torch
from kvxfer.kernels.aot import compile_ptx, nhd_plan
out = {}
for name, op, arch, dtype, head_dim, misalign in json.loads(sys.argv[1]):
    out[name] = compile_ptx(op, nhd_plan(getattr(torch, dtype), head_dim, misalign), arch)
json.dump(out, sys.stdout)
"""

WIDE = re.compile(r"\.(v4\.b32|v4\.u32|v2\.b64|v2\.u64)\b")


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # irrelevant to copies; silences triton 3.9's warning
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(CONFIGS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def _global_ops(text: str, kind: str) -> list[str]:
    return re.findall(rf"\b{kind}\.global(?:\.[\w]+)*", text)


def test_every_kernel_compiles(ptx):
    assert sorted(ptx) == sorted(c[0] for c in CONFIGS)
    for name, text in ptx.items():
        assert ".entry move_rows_kernel" in text, name
    assert ".target sm_90a" in ptx["aligned_bf16_gather_sm90"]
    assert ".target sm_80" in ptx["aligned_bf16_gather_sm80"]


@pytest.mark.parametrize(
    "name",
    [
        "aligned_bf16_gather_sm90",
        "aligned_bf16_scatter_sm90",
        "aligned_bf16_copy_sm90",
        "aligned_bf16_gather_sm80",
        "odd_dim96_bf16_gather_sm90",
        "fp8_gather_sm90",
    ],
)
def test_aligned_data_moves_in_128_bit_words(ptx, name):
    text = ptx[name]
    stores = _global_ops(text, "st")
    loads = _global_ops(text, "ld")
    assert stores and all(WIDE.search(s) for s in stores), f"{name}: non-128-bit stores {set(stores)}"
    assert any(WIDE.search(s) for s in loads), f"{name}: no 128-bit loads in {set(loads)}"


def test_misaligned_control_is_not_128_bit(ptx):
    """A 4-byte-aligned base must narrow the words: proves the 128-bit check can fail."""
    text = ptx["misaligned4_fp32_gather_sm90"]
    assert not any(WIDE.search(s) for s in _global_ops(text, "st") + _global_ops(text, "ld"))


def test_per_request_integers_are_not_specialised_and_tiles_are_bucketed():
    """A server must compile once per cache shape family, not per request size: the kernel's
    per-request integers are marked do_not_specialize (checked on the compiled JIT function,
    outside the interpreter) and GPU plans use a handful of token tiles for every size."""
    code = (
        "import json\n"
        "from kvxfer.kernels.rows import move_rows_kernel as k\n"
        "from kvxfer.kernels.launch import DEFAULT_TILE_BYTES, Plan\n"
        "names = [k.arg_names[i] if isinstance(i, int) else i for i in k.do_not_specialize]\n"
        "tiles = sorted({Plan(256, [256], n, interpreted=False).block_t for n in range(1, 70000, 7)})\n"
        "print(json.dumps({'names': names, 'tiles': tiles, 'tile_bytes': DEFAULT_TILE_BYTES}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout)
    assert sorted(got["names"]) == sorted(
        ["T", "num_t_tiles", "num_tiles", "src_head_start", "dst_head_start"]
    )
    # 256-byte rows: the smallest tile is 16 tokens, the largest the default tile's bytes / 256
    # (8 KiB: 32 tokens), every power of two between
    assert got["tile_bytes"] // 256 >= 32, got["tile_bytes"]
    want = [16 << k for k in range((got["tile_bytes"] // 256 // 16).bit_length())]
    assert got["tiles"] == want, (got["tiles"], want)
