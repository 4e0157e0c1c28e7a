"""Aux-loss-free load balancing (DeepSeek-V3, Liu et al. 2024, section 2.1.2), for the routers that choose experts by
score plus a per-expert bias (`e_score_correction_bias`: DeepSeek-V3, GLM-4.5). After each optimizer step every bias
moves by a fixed rate towards balance: b_i += rate * sign(mean load - load_i), a load being the tokens routed to
expert i. transformers keeps the bias as a buffer and nothing updates it in training; written here because no
library does.

Exact across ranks and accumulation: the loads are those of the optimizer step's *global* batch, counted over every
micro-batch (forward hooks on the routers, real tokens only: padding is skipped through the attention mask) and
summed over the ranks (one all-reduce per step), so 1 rank x GA4 and 2 ranks x GA2 move the biases alike. Gradient
checkpointing runs a router's forward again in backward: every count of that layer doubles, and sign(mean - load)
does not change.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from .aux import MaskTap, expert_loads
from .blocks import routers

# The paper's bias update speed (gamma) for most of its pre-training: the example the refusals and the run's line give.
PAPER_RATE = 0.001
BIAS = "e_score_correction_bias"


def biased_routers(model) -> list[torch.nn.Module]:
    """The routers of `model` that select experts by score plus a bias."""
    return [r for r in routers(model) if isinstance(getattr(r, BIAS, None), torch.Tensor)]


def bias_updates(loads: torch.Tensor, rate: float) -> torch.Tensor:
    """The update of each expert's bias from its load over the step (the module docstring), for rows of loads."""
    return rate * torch.sign(loads.mean(-1, keepdim=True) - loads)


class BiasBalancer(TrainerCallback):
    """Counts each biased router's per-expert loads over an optimizer step, then updates the biases (on_step_end: after
    the optimizer step, before a checkpoint saves them with the model)."""

    def __init__(self, model, rate: float):
        self.routers, self.rate = biased_routers(model), rate
        self.tap = MaskTap(model)
        self.loads: torch.Tensor | None = None  # [routers, experts], on the routers' device once they route
        self.handles = [r.register_forward_hook(self._count(i)) for i, r in enumerate(self.routers)]

    def _count(self, i: int):
        def hook(module, args, output):
            if not module.training:
                return
            indices = output[2]  # (router_logits, topk_weights, topk_indices)
            with torch.no_grad():
                if self.loads is None:
                    experts = getattr(module, BIAS).shape[0]
                    self.loads = torch.zeros(len(self.routers), experts, dtype=torch.float64, device=indices.device)
                self.loads[i] += expert_loads(indices, self.tap.flat(indices.shape[0]), self.loads.shape[1])
        return hook

    def on_step_end(self, args, state, control, **kwargs):
        if self.loads is None:
            return
        loads, self.loads = self.loads, None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loads)
        updates = bias_updates(loads, self.rate)
        with torch.no_grad():
            for router, update in zip(self.routers, updates):
                bias = getattr(router, BIAS)
                bias.add_(update.to(bias.device, bias.dtype))


def resolved_rate(cfg) -> float:
    """The bias update rate of a run, one rule for every method (SFT, DPO, GRPO, ...): opt-in, moe.bias_update_rate
    (`cfg`: the recipe's `moe:` section or None); unset or 0: off, the routers' biases stay as loaded. (On by default
    for SFT alone, a DPO or GRPO run of the same model left the biases where SFT moved them.)"""
    rate = getattr(cfg, "bias_update_rate", None)
    return float(rate) if rate else 0.0


def balancing_line(model, cfg) -> str | None:
    """The run's one line on bias balancing, on or off and why; None for a model without biased routers."""
    found = biased_routers(model)
    if not found:
        return None
    rate = resolved_rate(cfg)
    if rate:
        return f"moe: router bias balancing on: {len(found)} routers, rate {rate} (moe.bias_update_rate)"
    return (f"moe: router bias balancing off: the {len(found)} routers' biases ({BIAS}) stay as loaded "
            f"(moe.bias_update_rate unset; set it, e.g. {PAPER_RATE}, to move them towards balance each step)")


def bias_rate_problem(model, rate: float | None) -> str | None:
    """moe.bias_update_rate set (> 0) for a model whose routers have no bias to update."""
    if rate and not biased_routers(model):
        return (f"moe.bias_update_rate: {type(model).__name__} has no router with an expert bias "
                f"({BIAS}: DeepSeek-V3, GLM-4.5 and their kin have one); remove moe.bias_update_rate, or use "
                "moe.aux_loss_coef to balance this model's experts")
    return None
