"""Sparse upcycling (Komatsuzaki et al. 2022), which transformers lacks: each chosen dense MLP becomes E copies of it
plus a small random router, built as the family's native MoE class (Llama/Mistral -> Mixtral, Qwen2 -> Qwen2-MoE,
Qwen3 -> Qwen3-MoE) so the saved folder loads with `AutoModelForCausalLM` alone. Outputs equal the dense model's at
step 0:
- Mixtral and Qwen3-MoE (norm_topk_prob on) renormalise the router's softmax over the k chosen experts, and the
  experts are identical;
- Qwen2-MoE's shared expert, gated by sigmoid(0) = 0.5, is the dense MLP and the routed experts' down projections
  are halved (norm_topk_prob on): 0.5 MLP + 0.5 MLP = MLP, exact in floating point.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch
from transformers import AutoConfig, AutoTokenizer, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.initialization import no_init_weights
from transformers.integrations import is_deepspeed_zero3_enabled

from ..errors import MoeError
from ..heads import Head

# dense model_type -> the MoE model_type it is upcycled to
# (Qwen3-MoE's attention normalises q and k per head, which a Llama has not: Llama goes to Mixtral, exactly.)
UPCYCLE_TARGETS = {"llama": "mixtral", "mistral": "mixtral", "qwen2": "qwen2_moe", "qwen3": "qwen3_moe"}
# MoE families whose decoder layers can stay dense (Mixtral builds a sparse block in every layer)
PARTIAL_LAYERS = {"qwen2_moe", "qwen3_moe"}


def supported() -> str:
    return ", ".join(f"{k} -> {v}" for k, v in UPCYCLE_TARGETS.items())


def _layer_list(layers: Iterable[int] | None, n: int, key: str) -> list[int]:
    if layers is None:
        return list(range(n))
    out = sorted({int(i) for i in layers})
    bad = [i for i in out if not 0 <= i < n]
    if bad or not out:
        raise MoeError(f"{key}: layers must be a non-empty list of indices in 0..{n - 1}, got {list(layers)}")
    return out


def moe_config(dense_config, num_experts: int, top_k: int, layers: list[int]):
    """The native MoE config equivalent to `dense_config` with `layers` sparse."""
    c = dense_config
    target = UPCYCLE_TARGETS[c.model_type]
    common = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        hidden_act=c.hidden_act, max_position_embeddings=c.max_position_embeddings,
        initializer_range=c.initializer_range, rms_norm_eps=c.rms_norm_eps, use_cache=c.use_cache,
        pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
        tie_word_embeddings=c.tie_word_embeddings, rope_parameters=dict(c.rope_parameters),
        attention_dropout=c.attention_dropout, num_experts_per_tok=top_k, output_router_logits=False,
    )
    dense_layers = [i for i in range(c.num_hidden_layers) if i not in layers]
    if target == "mixtral":
        if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
            raise MoeError(f"--model: this {c.model_type} has attention/MLP biases, which Mixtral has no place for; "
                           "it cannot be upcycled exactly")
        cfg = MixtralConfig(**common, intermediate_size=c.intermediate_size, head_dim=getattr(c, "head_dim", None),
                            sliding_window=getattr(c, "sliding_window", None), num_local_experts=num_experts,
                            router_jitter_noise=0.0)
    elif target == "qwen3_moe":
        if c.use_sliding_window:
            raise MoeError("--model: this qwen3 uses a sliding window on some layers (max_window_layers), which "
                           "Qwen3-MoE has no place for; it cannot be upcycled exactly")
        cfg = Qwen3MoeConfig(
            **common, intermediate_size=c.intermediate_size, moe_intermediate_size=c.intermediate_size,
            num_experts=num_experts, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=dense_layers,
            attention_bias=c.attention_bias, use_sliding_window=False, sliding_window=c.sliding_window)
        cfg.head_dim = c.head_dim  # Qwen3's own (not hidden_size / heads); the MoE attention reads it the same way
    else:
        cfg = Qwen2MoeConfig(
            **common, intermediate_size=c.intermediate_size, moe_intermediate_size=c.intermediate_size,
            shared_expert_intermediate_size=c.intermediate_size, num_experts=num_experts, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=dense_layers, qkv_bias=True,
            use_sliding_window=c.use_sliding_window, sliding_window=c.sliding_window,
            max_window_layers=c.max_window_layers, layer_types=list(c.layer_types),
        )
    cfg.dtype = c.dtype
    return cfg


def upcycle(model, num_experts: int, top_k: int, layers: Iterable[int] | None = None,
            router_init_std: float | None = None, seed: int = 0):
    """A new native MoE model whose chosen MLPs are `num_experts` copies of `model`'s (see the module docstring).

    `router_init_std`: std of the routers' normal init (default: the config's initializer_range); the routers are
    seeded with `seed` so every rank builds the same model.
    """
    c = model.config
    chosen, target = _checked_choice(c, num_experts, top_k, layers)
    cfg = moe_config(c, num_experts, top_k, chosen)
    std = c.initializer_range if router_init_std is None else router_init_std
    state = _upcycled_state(model.state_dict(), c, target, chosen, num_experts, std, seed)
    with no_init_weights():  # every weight is set below; skip the random init
        moe = Head.CAUSAL_LM.auto_class.from_config(cfg, dtype=next(model.parameters()).dtype,
                                                    attn_implementation=c._attn_implementation)
    missing, unexpected = moe.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:  # a transformers change in parameter names: never save a half-initialised model
        raise RuntimeError(f"upcycling {c.model_type} -> {target}: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        moe.tie_weights()
    moe.generation_config = model.generation_config
    moe.train(model.training)
    return moe


def _checked_choice(c, num_experts: int, top_k: int, layers: Iterable[int] | None) -> tuple[list[int], str]:
    """The layers to upcycle and the MoE model type, after the request is checked against the dense config."""
    if c.model_type not in UPCYCLE_TARGETS:
        raise MoeError(f"--model / moe.upcycle: model type {c.model_type!r} has no MoE counterpart in transformers "
                       f"that hftrain can upcycle to; supported: {supported()}")
    if is_deepspeed_zero3_enabled():
        raise MoeError("moe.upcycle: the model is sharded by ZeRO-3 as it loads, so it cannot be upcycled in the "
                       "run; run `hftrain moe upcycle` first and set model.name_or_path to its output")
    if not (isinstance(num_experts, int) and num_experts >= 2):
        raise MoeError(f"--num-experts / moe.upcycle.num_experts: must be an integer >= 2, got {num_experts!r}")
    if not (isinstance(top_k, int) and 1 <= top_k <= num_experts):
        raise MoeError(f"--top-k / moe.upcycle.top_k: must be in 1..{num_experts} (num_experts), got {top_k!r}")
    n = c.num_hidden_layers
    chosen = _layer_list(layers, n, "--layers / moe.upcycle.layers")
    target = UPCYCLE_TARGETS[c.model_type]
    if len(chosen) < n and target not in PARTIAL_LAYERS:
        raise MoeError(f"--layers / moe.upcycle.layers: {target} (the MoE class for {c.model_type}) has a sparse "
                       f"block in every layer and no per-layer dense MLP, so every layer must be upcycled; omit the "
                       f"option (families that allow a subset: {', '.join(sorted(PARTIAL_LAYERS))})")
    return chosen, target


def _upcycled_state(dense: dict, c, target: str, chosen: list[int], num_experts: int, std: float, seed: int) -> dict:
    """The MoE model's state: the dense one with each chosen MLP as fused experts (copies), a router seeded with
    `seed`, and Qwen2-MoE's shared expert (the MLP itself, the experts carrying half)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for k, v in dense.items():
        parts = k.split(".")
        # model.layers.{i}.mlp.{gate,up,down}_proj.weight
        if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3] == "mlp" and int(parts[2]) in chosen:
            continue
        state[k] = v
    for i in chosen:
        p = f"model.layers.{i}.mlp."
        gate, up, down = dense[p + "gate_proj.weight"], dense[p + "up_proj.weight"], dense[p + "down_proj.weight"]
        scale = 0.5 if target == "qwen2_moe" else 1.0  # the shared expert carries the other half
        state[p + "experts.gate_up_proj"] = torch.cat([gate, up], 0).unsqueeze(0).repeat(num_experts, 1, 1)
        state[p + "experts.down_proj"] = (down * scale).unsqueeze(0).repeat(num_experts, 1, 1)
        router = torch.randn(num_experts, c.hidden_size, generator=gen, dtype=torch.float32) * std
        state[p + "gate.weight"] = router.to(gate.dtype)
        if target == "qwen2_moe":
            state[p + "shared_expert.gate_proj.weight"] = gate.clone()
            state[p + "shared_expert.up_proj.weight"] = up.clone()
            state[p + "shared_expert.down_proj.weight"] = down.clone()
            state[p + "shared_expert_gate.weight"] = torch.zeros(1, c.hidden_size, dtype=gate.dtype)
    return state


def upcycle_folder(src: str, output: str, num_experts: int, top_k: int, layers: list[int] | None = None,
                   router_init_std: float | None = None, seed: int = 0) -> str:
    """`hftrain moe upcycle`: load `src` (safetensors), upcycle, save model + tokenizer to `output`."""
    if not os.path.isdir(src):
        raise MoeError(f"--model: {src} is not a folder (a local model folder, e.g. from save_pretrained)")
    model_type = AutoConfig.from_pretrained(src).model_type
    if model_type not in UPCYCLE_TARGETS:
        raise MoeError(f"--model: model type {model_type!r} has no MoE counterpart in transformers that hftrain can "
                       f"upcycle to; supported: {supported()}")
    dense = Head.CAUSAL_LM.auto_class.from_pretrained(src, dtype="auto", use_safetensors=True)  # MoE: causal LMs
    moe = upcycle(dense, num_experts, top_k, layers, router_init_std, seed)
    os.makedirs(output, exist_ok=True)
    moe.save_pretrained(output, safe_serialization=True)
    try:
        AutoTokenizer.from_pretrained(src).save_pretrained(output)
    except (OSError, ValueError):  # a folder with weights only: nothing to copy
        pass
    return output
