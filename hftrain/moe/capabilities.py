"""What a model can honour of the `moe:` section. Every key asked of a family that cannot honour it is refused, naming
the key and what to use instead, never accepted and then failing or ignored. One function judges a model: the run's
preflight and `hftrain check` ask it of the model built from its config on the meta device (before anything loads),
moe.attach of the loaded model (a model check could not read, e.g. one on the Hub).
"""

from __future__ import annotations

import inspect

from .balance import BIAS, bias_rate_problem, biased_routers
from .blocks import moe_blocks, routers
from .expert_parallel import check_reproducible

Problems = list[tuple[str, str]]  # (key as the user spells it, message with the fix)


def computes_aux_loss(model) -> bool:
    """Whether the model's forward returns the family's load-balancing loss (`outputs.aux_loss`) when
    config.output_router_logits is set. transformers' families that have one call their `load_balancing_loss_func`
    from the causal LM's forward (Mixtral, Qwen-MoE, OLMoE, gpt-oss, Granite-MoE, ...); DeepSeek-V3, GLM-4.5 and
    the other families balanced by a router bias, or by nothing, return none (tests/test_moe_refusals.py holds this
    against the families' real forwards)."""
    code = getattr(inspect.unwrap(type(model).forward), "__code__", None)
    return code is not None and "load_balancing_loss_func" in code.co_names


def _no_router(model, key: str) -> str | None:
    if routers(model) and hasattr(model.config.get_text_config(), "output_router_logits"):  # a VLM's: its text's
        return None
    return (f"{type(model).__name__} has no MoE router (no sparse block found and no config.output_router_logits): "
            f"use an MoE model, set moe.upcycle, or remove {key}")


def loss_problems(model, aux_loss_coef, router_z_loss_coef) -> Problems:
    """moe.aux_loss_coef asked of a model that returns no load-balancing loss; either router loss asked of a model
    without routers whose logits it returns."""
    out: Problems = []
    for key, coef in (("moe.aux_loss_coef", aux_loss_coef), ("moe.router_z_loss_coef", router_z_loss_coef)):
        no_router = _no_router(model, key) if coef else None
        if no_router:
            out.append((key, no_router))
    if aux_loss_coef and not out and not computes_aux_loss(model):
        instead = (f"its routers balance the experts by a per-expert bias ({BIAS}): remove moe.aux_loss_coef and "
                   "set moe.bias_update_rate (e.g. 0.001, DeepSeek-V3's) to move those biases towards balance"
                   if biased_routers(model) else
                   "remove moe.aux_loss_coef (moe.router_z_loss_coef needs only the router logits)")
        out.append(("moe.aux_loss_coef", f"{type(model).__name__} computes no load-balancing loss (its forward returns "
                    f"no aux_loss); {instead}"))
    return out


def expert_parallel_problems(model, expert_parallel_size, capacity_factor) -> Problems:
    """moe.expert_parallel_size / moe.capacity_factor (both swap the blocks for the expert-parallel layer) asked of a
    model whose blocks that layer does not compute as the family does, or whose experts the ranks cannot share."""
    parallel = isinstance(expert_parallel_size, int) and expert_parallel_size > 1
    if not (parallel or capacity_factor):
        return []
    key = "moe.expert_parallel_size" if parallel else "moe.capacity_factor"
    no_router = _no_router(model, key)
    if no_router:
        return [(key, no_router)]
    blocks = moe_blocks(model)
    for block in {type(b): b for b in blocks}.values():
        try:
            check_reproducible(block)
        except ValueError as e:
            return [(key, str(e).split(": ", 1)[1])]
    experts = blocks[0].experts.gate_up_proj.shape[0]
    if parallel and experts % expert_parallel_size:
        return [(key, f"{expert_parallel_size} does not divide the model's {experts} experts per layer")]
    return []


def section_problems(model, cfg) -> Problems:
    """Every key of the `moe:` section `cfg` that `model` cannot honour."""
    out = loss_problems(model, cfg.aux_loss_coef, cfg.router_z_loss_coef)
    out += expert_parallel_problems(model, cfg.expert_parallel_size, cfg.capacity_factor)
    bias = bias_rate_problem(model, cfg.bias_update_rate)
    if bias:
        out.append(("moe.bias_update_rate", bias.split(": ", 1)[1]))
    return out
