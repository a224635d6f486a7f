"""The tiny random models, prompts and expected-bytes arithmetic of the tier-3 harness
(``tests/vllm_e2e.py``), also used by tier 4 (``tests/vllm_served.py``), the vLLM scheduler tests
and ``profiling/bench_vllm_pd.py``.

:func:`write_model` saves a tiny model (transformers' random init, seeded) and a byte-level
tokenizer: a Llama (optionally every layer a sliding window, :func:`sliding`), a Gemma-3 (sliding
and full attention groups) or a model with state groups (GraniteMoeHybrid, Qwen3-Next);
:func:`prompts` makes the random prompts and the prefix-hit one; :func:`layer_windows`,
:func:`handed_off`, :func:`expected_bytes` and :func:`state_bytes` say which prompts P hands off
and how many bytes each load must move, :func:`one_sided_problems` which loads must be read
one-sided. No vLLM import here (torch and transformers only inside :func:`write_model`).
"""

from __future__ import annotations

import math
import random

BLOCK = 32  # vLLM's CPU attention takes multiples of 32
MODEL = {  # a tiny Llama: 2 layers, 2 kv heads of 32, fp32
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.2,  # transformers' normal init, wider than its 0.02 default: peaked logits
}
DEFAULT_LENGTHS = (1, 31, 33, 70, 97, 160)
MUTATE_LEN = 70  # the prompt whose last loaded block is perturbed by --mutate-k


GEMMA3_WINDOW = 48  # the tiny Gemma-3's sliding window (5 sliding layers : 1 full)
STATE_MODELS = ("granite", "qwen3_next")  # models with state groups (the N-1 flow)
DTYPES = {"qwen3_next": "bfloat16"}  # vLLM's CPU GDN kernels take bf16 only; others fp32


def _state_model(kind: str):
    """(config, model) of a tiny model with state groups, transformers' random init."""
    import torch

    common = {k: MODEL[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")}
    common.update(
        vocab_size=MODEL["vocab_size"], max_position_embeddings=MODEL["max_position_embeddings"],
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    if kind == "granite":
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        cfg = GraniteMoeHybridConfig(
            num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, intermediate_size=128,
            num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=128, mamba_n_heads=8,
            mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
            position_embedding_type="rope", initializer_range=0.2, **common,
        )  # fmt: skip
        cfg.architectures = ["GraniteMoeHybridForCausalLM"]
        return cfg, GraniteMoeHybridForCausalLM(cfg).to(torch.float32)
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # vLLM's CPU GDN kernels take 128-wide heads only; 128-wide attention heads keep the hybrid
    # block (an attention page holds a state page) at 96 tokens
    common.update(head_dim=128)
    cfg = Qwen3NextConfig(
        num_hidden_layers=4, intermediate_size=128, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=1, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        initializer_range=0.1, **common,
    )  # fmt: skip
    cfg.architectures = ["Qwen3NextForCausalLM"]
    model = Qwen3NextForCausalLM(cfg)
    with torch.no_grad():  # a long-lived recurrent state: transformers' A in [0.01, 16] forgets it at once
        for mod in model.modules():
            if hasattr(mod, "A_log"):
                mod.A_log.fill_(math.log(0.05))
    return cfg, model.to(torch.bfloat16)


def write_model(model_dir: str, seed: int = 0, kind: str = "llama", **overrides) -> str:
    """Save the tiny model (transformers' random init under ``seed``) and a byte-level tokenizer:
    ``kind`` "llama" (``overrides`` may make its layers sliding-window), "gemma3" (6 layers,
    5 sliding-window : 1 full attention: six KV cache groups with vLLM's hybrid allocator),
    "granite" or "qwen3_next" (state groups, :func:`_state_model`)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    if kind == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
        cfg = Gemma3TextConfig(
            **{k: MODEL[k] for k in keep},
            num_hidden_layers=6,
            sliding_window=GEMMA3_WINDOW,
            vocab_size=MODEL["vocab_size"],
            max_position_embeddings=MODEL["max_position_embeddings"],
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            initializer_range=0.2,
        )
        cfg.architectures = ["Gemma3ForCausalLM"]
        model = Gemma3ForCausalLM(cfg).to(torch.float32)
    elif kind in STATE_MODELS:
        cfg, model = _state_model(kind)
    else:
        cfg = LlamaConfig(**{**MODEL, **overrides})
        model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(model_dir, safe_serialization=True)
    byte_symbols = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for sym in sorted(byte_symbols):
        vocab[sym] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(model_dir)
    return model_dir


def sliding(window: int) -> dict:
    """Model overrides that make every layer a sliding-window one (none for 0)."""
    if not window:
        return {}
    return {"sliding_window": window, "layer_types": ["sliding_attention"] * MODEL["num_hidden_layers"]}


def prompts(lengths, seed: int = 1) -> list[list[int]]:
    """Random prompts of ``lengths``, then the prefix-hit prompt: the first two blocks of the
    ``MUTATE_LEN``-token prompt (or of the longest) and 33 new tokens."""
    rng = random.Random(seed)
    out = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    base = next((p for p in out if len(p) == MUTATE_LEN), max(out, key=len))
    if len(base) >= 2 * BLOCK:
        out.append(base[: 2 * BLOCK] + [rng.randrange(3, 500) for _ in range(33)])
    return out


def layer_windows(kind: str, sliding_window: int) -> list[int | None]:
    """Each layer's sliding window (None: full attention) of the model ``write_model`` makes."""
    if kind == "gemma3":
        return [GEMMA3_WINDOW] * 5 + [None]
    return [sliding_window or None] * MODEL["num_hidden_layers"]


def handed_off(n: int, windows) -> bool:
    """Whether P hands a prompt of ``n`` tokens off: not when a window's first token for the
    last prompt token (which D computes again), ``n - w``, lies in a block vLLM already freed
    (it frees the blocks before token ``n - w + 1``)."""
    return all(w is None or (n - w + 1) % BLOCK or n - w + 1 < BLOCK for w in windows)


def expected_bytes(n: int, hit: int, windows, bytes_per_token: int) -> int:
    """Bytes a load of a prompt of ``n`` tokens moves into D holding ``hit`` tokens: per layer,
    whole blocks (CPU_ATTN pages) from the block holding the first token it needs (a sliding
    layer: ``n - w``, the window of the last prompt token, which D computes again)."""
    per_layer = bytes_per_token // len(windows)
    end = -(-n // BLOCK) * BLOCK
    total = 0
    for w in windows:
        start = 0 if w is None else max(0, n - w) // BLOCK * BLOCK
        total += (end - max(hit, start)) * per_layer
    return total


def state_bytes(n: int, d: dict) -> dict:
    """A state model's load of a prompt of ``n`` tokens (N-1 moved): ``want``, what kvxfer moves
    (whole pages: CPU_ATTN attention pages over the N-1 tokens, one padded state page per state
    layer); ``minimum``, the N-1 tokens' K/V rows plus each state layer's state content;
    ``everything``, every layer's pages over those tokens (a connector blind to the groups)."""
    bs, layers = d["block_size"], d["num_layers"]
    page = d["bytes_per_token"] // layers * bs
    attn = sum(g["layers"] for g in d["groups"] if not g["state"])
    state = [g for g in d["groups"] if g["state"]]
    m = n - 1
    blocks = -(-m // bs)
    return {
        "want": (blocks * attn + sum(g["layers"] for g in state)) * page,
        "minimum": m * page // bs * attn + sum(g["layers"] * g["content_bytes"] for g in state),
        "everything": blocks * layers * page,
    }


def one_sided_problems(d: dict) -> list[str]:
    """Over ``ipc``, D maps P on its first hand-off; every later load must then read one-sided
    (no message to P), as a server's later requests do."""
    if d.get("transports") != {"P": "ipc"}:
        return []
    loaded = [(i, r) for i, r in enumerate(d["results"]) if r["handed_off"] and r["transfers"]]
    return [
        f"prompt {i}: {r['transfers'] - r['onesided_loads']} load(s) through the messaged path, want "
        f"one-sided (D's one-sided fallbacks: {d['onesided'].get('fallbacks')})"
        for i, r in loaded[1:]
        if r["onesided_loads"] != r["transfers"]
    ]
