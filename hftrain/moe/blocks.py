"""Finding the sparse MoE blocks and routers of any transformers MoE model, and making them ZeRO-3 leaf modules."""

from __future__ import annotations

import torch


ROUTER_NAMES = ("gate", "router")  # gpt-oss calls its block's router `router`; the other families `gate`


def router_of(block: torch.nn.Module) -> torch.nn.Module | None:
    """The router child of an MoE block. Every family's router (transformers 5) returns (logits, top-k weights, top-k
    expert ids). A router LoRA adapts (peft's all-linear wraps DeepSeek-V3's and GLM-4.5's in a ParamWrapper) is the
    router it wraps, which still runs in its forward and holds the expert bias: seen through the wrapper, bias
    balancing, the aux losses and the load counts find it (they found none: 'no router with an expert bias')."""
    router = next((r for r in (getattr(block, n, None) for n in ROUTER_NAMES) if isinstance(r, torch.nn.Module)), None)
    if router is not None and hasattr(router, "lora_A") and isinstance(getattr(router, "base_layer", None),
                                                                         torch.nn.Module):
        return router.base_layer
    return router


def moe_blocks(model) -> list[torch.nn.Module]:
    """Sparse MoE blocks: modules with a router child and an `experts` child (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss,
    DeepSeek-V3, GLM-4.5), or hftrain's expert-parallel layer."""
    return [m for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)
            and router_of(m) is not None]


def routers(model) -> list[torch.nn.Module]:
    return [router_of(b) for b in moe_blocks(model)]


def unwrap(model):
    while hasattr(model, "module"):  # DDP / DeepSpeed engine
        model = model.module
    return model


def register_zero3_leaf_modules(model) -> list[str]:
    """Make every MoE block one ZeRO-3 unit (DeepSpeed gathers all its parameters at once), so a rank whose tokens
    skip an expert does not wait for a gather the other ranks never issue. Same call as accelerate's
    `DeepSpeedPlugin.set_moe_leaf_modules`, with the classes found in the model instead of named in an env var."""
    # optional dependency: only ZeRO-3 runs call this
    from deepspeed.utils import set_z3_leaf_modules
    from deepspeed.utils.z3_leaf_module import get_z3_leaf_modules

    classes = sorted({type(b) for b in moe_blocks(model)}, key=lambda t: t.__name__)
    if classes:
        set_z3_leaf_modules(model, classes)
    return [f"{c.__name__} x{sum(type(m) is c for m in get_z3_leaf_modules(model))}" for c in classes]

