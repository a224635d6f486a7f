"""The rules a state group's :class:`~kvxfer.groups.state.StateSpec` follows beyond its field
types: what each kind's conv parts and SSM state must look like (the shapes vLLM's mixers
make), and which TP sizes can shard it. ``StateSpec.__post_init__`` runs them.
"""

from __future__ import annotations

from .state_types import StateKind

__all__ = ["check_kind", "check_tp"]


def check_kind(spec) -> None:
    """The fields of ``spec`` (a :class:`~kvxfer.groups.state.StateSpec`) that its kind fixes:
    which kinds have an SSM state and an SSM order choice, which parts are per channel or
    replicated, and the SSM head shape its conv parts make; ``ValueError`` naming them."""
    parts, shape, kind = spec.conv_parts, spec.ssm_head_shape, spec.kind
    if spec.ssm_transposed and kind is not StateKind.GDN:
        raise ValueError(f"ssm_transposed: only a gdn state has an SSM order choice, not {kind.value}")
    if kind is StateKind.SHORT_CONV:
        if spec.ssm_heads or shape:
            raise ValueError("ssm_heads/ssm_head_shape: a short_conv state has no SSM state (0, ())")
        if parts[0].unit_width != 1 or parts[0].replicate:
            raise ValueError("conv parts: short_conv's bx part is per channel (unit_width 1, not replicated)")
        return
    if spec.ssm_heads < 1:
        raise ValueError(f"ssm_heads: a {kind.value} state has SSM heads, got {spec.ssm_heads}")
    if kind is StateKind.MAMBA1:
        (x,) = parts
        if x.unit_width != 1 or x.replicate:
            raise ValueError("conv parts: mamba1's x part is per channel (unit_width 1, not replicated)")
        if len(shape) != 1 or spec.ssm_heads != x.num_units:
            raise ValueError(
                f"ssm_heads/ssm_head_shape: mamba1's SSM state is [intermediate={x.num_units}, d_state], "
                f"got {spec.ssm_heads} heads of {shape}"
            )
    elif kind is StateKind.MAMBA2:
        x, b, c = parts
        if (b.num_units, b.unit_width, b.replicate) != (c.num_units, c.unit_width, c.replicate):
            raise ValueError(f"conv parts: mamba2's B and C must match, got {b} and {c}")
        if x.replicate:
            raise ValueError("conv parts: mamba2's x part is sharded by head, not replicated")
        if len(shape) != 2 or shape != (x.unit_width, b.unit_width) or spec.ssm_heads != x.num_units:
            raise ValueError(
                f"ssm_heads/ssm_head_shape: mamba2's SSM state is [num_heads={x.num_units}, "
                f"head_dim={x.unit_width}, d_state={b.unit_width}], got {spec.ssm_heads} heads of {shape}"
            )
    else:  # GDN
        q, k, v = parts
        if (q.num_units, q.unit_width, q.replicate) != (k.num_units, k.unit_width, k.replicate):
            raise ValueError(f"conv parts: gdn's q and k must match, got {q} and {k}")
        if v.replicate:
            raise ValueError("conv parts: gdn's v part is sharded by head, not replicated")
        if len(shape) != 2 or shape != (v.unit_width, q.unit_width) or spec.ssm_heads != v.num_units:
            raise ValueError(
                f"ssm_heads/ssm_head_shape: gdn's SSM state is [num_v_heads={v.num_units}, "
                f"head_v_dim={v.unit_width}, head_k_dim={q.unit_width}] (canonical order), got "
                f"{spec.ssm_heads} heads of {shape}"
            )


def check_tp(spec) -> None:
    """``spec``'s TP size against every section's units (a divisor, or a multiple of a
    replicated part's) and vLLM's Mamba2 group rule; ``ValueError`` naming them."""
    tp = spec.tp_size
    for sec in spec.sections:
        u = sec.num_units
        if u % tp == 0:
            continue
        if sec.replicate and u < tp and tp % u == 0:
            continue
        how = "a multiple of it to replicate" if sec.replicate else "a divisor of it"
        raise ValueError(f"tp_size: {tp} is not {how}: {sec.name} has {u} units")
    if spec.kind is StateKind.MAMBA2:
        groups = spec.conv_parts[1].num_units
        if groups % tp and groups != 1:  # MambaMixer2's assertion (vLLM 0.32/0.33)
            raise ValueError(
                f"tp_size: vLLM needs n_groups % tp == 0 or n_groups == 1, got n_groups={groups}, tp={tp}"
            )
