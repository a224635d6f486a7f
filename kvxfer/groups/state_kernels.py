"""Triton backend of the state ops (``backend="triton"`` of :mod:`kvxfer.groups.state_ops`): one
launch per section moves every row of a run, whatever the number of layers and states.

The host computes the rows as :mod:`~kvxfer.groups.state_ops` does for the torch reference
(byte offsets in page order) and hands the kernel two int64 address tables, one entry per row:
where each row starts on the source and on the destination (absolute addresses: ``data_ptr()``
values, cast to pointers in the kernel; a pinned host wire is reached through its device
address, as the attention kernels do). Rows move as integer words of the widest width the
alignment of every address and the row length allows, so every dtype moves bit-exactly. Page
order <-> wire order permutations (DS conv units, transposed SSM heads) stay torch copies on
the staged run.

Where it runs: CUDA tensors when triton imports and a GPU is visible; CPU tensors only under
Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is first imported), which is how
CI runs it. Not run on a GPU yet.
"""

from __future__ import annotations

import torch

__all__ = ["copy_rows", "unavailable_reason"]

_BLOCK_ROWS = 16


def unavailable_reason(device: torch.device) -> str:
    """Why the kernel cannot run on ``device`` in this process ("" when it can)."""
    try:
        import triton

        from .. import kernels  # noqa: F401  (the attention kernels' interpreter check)
        from ..kernels.launch import INTERPRETED
    except ImportError as e:
        return f"triton does not import: {e}"
    del triton
    if device.type == "cuda":
        if INTERPRETED:
            return "TRITON_INTERPRET=1 is set: the interpreter runs CPU tensors only"
        return "" if torch.cuda.is_available() else "no CUDA device is visible"
    if device.type == "cpu":
        return "" if INTERPRETED else "CPU tensors need TRITON_INTERPRET=1 set before triton loads"
    return f"no Triton backend for {device.type} tensors"


def _kernel():
    import triton
    import triton.language as tl

    global _COPY_ROWS
    if _COPY_ROWS is not None:
        return _COPY_ROWS

    @triton.jit(do_not_specialize=("num_rows",))
    def copy_rows_kernel(
        src_addr,
        dst_addr,
        num_rows,
        WORD: tl.constexpr,
        ROW_WORDS: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        """Copy rows ``[pid*BLOCK_ROWS, +BLOCK_ROWS)``: ``ROW_WORDS`` words from ``src_addr[i]``
        to ``dst_addr[i]`` each."""
        pid = tl.program_id(0).to(tl.int64)
        rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        rmask = rows < num_rows
        s = tl.load(src_addr + rows, mask=rmask, other=0).to(tl.pointer_type(WORD))
        d = tl.load(dst_addr + rows, mask=rmask, other=0).to(tl.pointer_type(WORD))
        for w0 in range(0, ROW_WORDS, BLOCK_W):
            col = w0 + tl.arange(0, BLOCK_W)
            mask = rmask[:, None] & (col < ROW_WORDS)[None, :]
            vals = tl.load(s[:, None] + col[None, :], mask=mask)
            tl.store(d[:, None] + col[None, :], vals, mask=mask)

    _COPY_ROWS = copy_rows_kernel
    return _COPY_ROWS


_COPY_ROWS = None


def copy_rows(
    src_addr: torch.Tensor, dst_addr: torch.Tensor, row_bytes: int, word_bytes: int, device
) -> None:
    """Move ``row_bytes`` from each ``src_addr[i]`` to ``dst_addr[i]`` (int64 CPU tensors of
    absolute addresses, every one a multiple of ``word_bytes``, which divides ``row_bytes``) in
    one launch on ``device``'s stream."""
    import triton
    import triton.language as tl

    words = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
    num_rows = int(src_addr.numel())
    if not num_rows:
        return
    row_words = row_bytes // word_bytes
    block_w = min(triton.next_power_of_2(row_words), 1024)
    src = src_addr.to(device, non_blocking=True)
    dst = dst_addr.to(device, non_blocking=True)
    grid = (triton.cdiv(num_rows, _BLOCK_ROWS),)
    _kernel()[grid](src, dst, num_rows, words[word_bytes], row_words, _BLOCK_ROWS, block_w)
