"""A vLLM state group (``MambaSpec``: Mamba1, Mamba2, Gated DeltaNet, short conv) as a kvxfer
:class:`~kvxfer.groups.state.StateSpec` (no vLLM import; the spec is duck-typed).

Facts used (vLLM 0.32, docs/research/vllm-hybrid.md §3): ``MambaSpec.shapes`` are one TP rank's
``(conv, ssm)`` shapes (``(conv,)`` for short conv), the conv state ``(state_len, dim)`` in the
default ``SD`` layout or ``(dim, state_len)`` with ``VLLM_SSM_CONV_STATE_LAYOUT=DS``, with
``state_len = conv_kernel - 1 + num_speculative_blocks``; Mamba2's SSM state is ``[heads,
head_dim, d_state]`` and its conv channels ``[x | B | C]`` (``n_groups`` extended to the TP size
when it is 1, then replicated); GDN's SSM state is ``[v_heads, head_v_dim, head_k_dim]`` in the
spec (vLLM's CPU backend reads the same bytes as ``[.., K, V]``: ``ssm_transposed``) and its conv
channels ``[q | k | v]``; Mamba1's SSM state is ``[intermediate, d_state]``. Every state is
sharded by TP, so the whole-model sizes are the per-rank ones times the TP size.

:func:`state_spec_from_vllm` builds the StateSpec and checks it reproduces vLLM's shapes, dtypes
and page exactly; anything else (another cache mode than "none" or "align", ReplaySSM's extra states, linear attention, KDA, a
TP-replicated state, ...) is refused with the reason, for the caller to name the group.
"""

from __future__ import annotations

import os

import torch

from ..groups.state import ConvLayout, StateSpec

__all__ = ["CONV_LAYOUT_ENV", "attention_view_of_state", "conv_layout_from_env", "state_spec_from_vllm"]

CONV_LAYOUT_ENV = "VLLM_SSM_CONV_STATE_LAYOUT"  # vLLM's switch (envs.py; default SD)
_KINDS = ("MAMBA1", "MAMBA2", "GDN_ATTN", "SHORT_CONV")


def conv_layout_from_env(environ=None) -> ConvLayout:
    """vLLM's conv state layout: ``VLLM_SSM_CONV_STATE_LAYOUT`` (``SD`` when unset)."""
    v = (environ if environ is not None else os.environ).get(CONV_LAYOUT_ENV) or "SD"
    try:
        return ConvLayout(v.upper())
    except ValueError:
        raise ValueError(f"{CONV_LAYOUT_ENV}={v!r}: vLLM takes SD or DS") from None


def _dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    got = getattr(torch, str(d).replace("torch.", ""), None)
    if not isinstance(got, torch.dtype):
        raise ValueError(f"state dtype {d!r} is not a torch dtype")
    return got


def _hf(hf_config, *names: str):
    """The first of ``names`` the model config has (None: none of them)."""
    for n in names:
        v = getattr(hf_config, n, None)
        if v is not None:
            return int(v)
    return None


def state_spec_from_vllm(
    spec,
    num_layers: int,
    tp_size: int = 1,
    *,
    hf_config=None,
    conv_layout: ConvLayout | str = ConvLayout.SD,
    gdn_ssm_transposed: bool = False,
) -> StateSpec:
    """The :class:`StateSpec` of a ``MambaSpec`` group of ``num_layers`` layers on an engine of
    ``tp_size`` ranks. ``hf_config``: the model's config (Mamba2's ``n_groups`` under TP, where
    the shapes hold the extended count); ``conv_layout``: vLLM's (:func:`conv_layout_from_env`);
    ``gdn_ssm_transposed``: the engine reads GDN SSM states as ``[h, K, V]`` (vLLM's CPU
    backend). ``ValueError`` says why the group cannot be carried."""
    kind = getattr(getattr(spec, "mamba_type", None), "name", str(getattr(spec, "mamba_type", "?")))
    if kind not in _KINDS:
        raise ValueError(f"state kind {kind} is not carried (Mamba1, Mamba2, GDN and short conv are)")
    mode = str(getattr(spec, "mamba_cache_mode", "none"))
    if mode not in ("none", "align"):
        raise ValueError(
            f"mamba_cache_mode {mode!r} is not carried (only 'none' and 'align', vLLM's modes without and "
            "with prefix caching)"
        )
    if getattr(spec, "tp_replicated", False):
        raise ValueError("a TP-replicated state is not carried")
    shapes = tuple(tuple(int(x) for x in s) for s in spec.shapes)
    dtypes = tuple(_dtype(d) for d in spec.dtypes)
    want = 1 if kind == "SHORT_CONV" else 2
    if len(shapes) != want or len(dtypes) != want:
        raise ValueError(
            f"{kind} state with {len(shapes)} state tensors {list(shapes)}: only conv"
            f"{'' if want == 1 else ' + SSM'} is carried (ReplaySSM and other extra states are not)"
        )
    spec_blocks = int(getattr(spec, "num_speculative_blocks", 0) or 0)
    layout = ConvLayout(conv_layout)
    conv = shapes[0]
    if len(conv) != 2:
        raise ValueError(f"conv state shape {conv}: expected 2 dims")
    state_len, dim = conv if layout is ConvLayout.SD else conv[::-1]
    kernel = state_len + 1 - spec_blocks
    if kernel < 2:
        raise ValueError(
            f"conv state shape {conv} ({layout.value}): {state_len} rows for {spec_blocks} spec tokens"
        )
    page = getattr(spec, "page_size_padded", None)
    common = dict(
        num_layers=num_layers, conv_kernel=kernel, conv_dtype=dtypes[0], tp_size=tp_size, conv_layout=layout,
        num_speculative_tokens=spec_blocks, page_size_bytes=int(page) if page else None,
    )  # fmt: skip
    if kind == "SHORT_CONV":
        state = StateSpec.short_conv(dim=dim * tp_size, **common)
    elif kind == "MAMBA1":
        inter, d_state = shapes[1]
        state = StateSpec.mamba1(
            intermediate_size=inter * tp_size, d_state=d_state, ssm_dtype=dtypes[1], **common
        )
    elif kind == "MAMBA2":
        heads, head_dim, d_state = shapes[1]
        groups_local, rest = divmod(dim - heads * head_dim, 2 * d_state)
        if rest or groups_local < 1:
            raise ValueError(
                f"Mamba2 conv dim {dim} is not x ({heads}x{head_dim}) + B + C of d_state {d_state}"
            )
        n_groups = groups_local * tp_size
        hf_groups = _hf(hf_config, "mamba_n_groups", "n_groups", "ngroups")
        if hf_groups == 1 and n_groups == tp_size:  # vLLM extends one group to one per rank
            n_groups = 1
        state = StateSpec.mamba2(
            num_heads=heads * tp_size, head_dim=head_dim, n_groups=n_groups, d_state=d_state,
            ssm_dtype=dtypes[1], **common,
        )  # fmt: skip
    else:  # GDN_ATTN: SSM [v_heads, V, K] in the spec
        v_heads, v_dim, k_dim = shapes[1]
        key_local, rest = divmod(dim - v_heads * v_dim, 2)
        if rest or key_local < 1 or key_local % k_dim:
            raise ValueError(f"GDN conv dim {dim} is not q + k ({k_dim}-wide heads) + v ({v_heads}x{v_dim})")
        state = StateSpec.gdn(
            num_k_heads=key_local // k_dim * tp_size, num_v_heads=v_heads * tp_size, head_k_dim=k_dim,
            head_v_dim=v_dim, ssm_dtype=dtypes[1], ssm_transposed=gdn_ssm_transposed, **common,
        )  # fmt: skip
    if state.vllm_shapes() != shapes:
        raise ValueError(
            f"state shapes {list(shapes)} are not those kvxfer derives, {list(state.vllm_shapes())}"
        )
    return state


def attention_view_of_state(state: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """A state layer's pages as an attention-shaped tensor: ``template``'s shape, strides and
    dtype (an attention layer's ``[B, H, N, C]`` view), over ``state``'s memory (vLLM's int8
    ``[B, 1, 1, C]`` view of the layer, strided by the padded page), so that block ``b`` of the
    result covers the state layer's page ``b``. vLLM's hybrid allocator pads every group's page to
    one size, so the strides agree; ``ValueError`` names what does not."""
    if not isinstance(state, torch.Tensor) or state.dim() != 4:
        raise ValueError(
            f"state cache: expected vLLM's [blocks, 1, 1, bytes] view, got {getattr(state, 'shape', state)}"
        )
    page = template.stride(0) * template.element_size()
    if state.stride(0) * state.element_size() != page:
        raise ValueError(
            f"state cache: pages of {state.stride(0) * state.element_size()} bytes, the attention layers' "
            f"{page}: kvxfer needs one page size (vLLM's hybrid allocator pads them to one)"
        )
    if state.shape[0] != template.shape[0] or state.device != template.device:
        raise ValueError(
            f"state cache: {state.shape[0]} blocks on {state.device}, the attention layers {template.shape[0]} "
            f"on {template.device}"
        )
    off = state.storage_offset() * state.element_size()
    if off % template.element_size():
        raise ValueError(f"state cache: byte offset {off} is not aligned to {template.dtype}")
    base = torch.empty(0, dtype=template.dtype, device=template.device).set_(state.untyped_storage())
    return base.as_strided(template.shape, template.stride(), off // template.element_size())
