"""Mixture of experts: upcycling dense models to native MoE classes, router aux / z losses, aux-loss-free balancing of
biased routers, router health, expert parallelism. `attach(trainer, recipe.moe)` wires it into a Trainer, called by
mixin.MoeMixin as the trainer is built (the one way MoE enters a trainer), which also holds the trainer's part of
expert parallelism (the gradient norm and the optimizer state over every rank's experts)."""

from __future__ import annotations

import torch.distributed as dist
from transformers.integrations import is_deepspeed_zero3_enabled

from ..distributed import print0
from ..errors import MoeError
from . import expert_parallel as ep
from .aux import MaskTap, model_aux_loss, z_loss
from .balance import BiasBalancer, biased_routers, resolved_rate
from .blocks import register_zero3_leaf_modules, routers, unwrap
from .capabilities import section_problems
from .health import RouterHealthCallback


def attach(trainer, cfg=None) -> dict:
    """Wire MoE into an SFTTrainer before train(): ZeRO-3 leaf modules for any MoE block, and with a `moe:` section
    the aux / z losses through `trainer.aux_losses` (scaled by losses.aux_loss_term, so exact over ranks and
    accumulation), expert parallelism, the router-health callback and the bias balancing it asks for. A key the model
    cannot honour is refused (capabilities.py; preflight refuses it before the model loads). Returns what was done
    (for the log)."""
    model = unwrap(trainer.model)
    done: dict = {}
    if is_deepspeed_zero3_enabled():
        leaves = register_zero3_leaf_modules(model)
        if leaves:  # a dense model has none: nothing to say
            done["zero3_leaf_modules"] = leaves
    if cfg is not None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        problems = section_problems(base, cfg)
        if problems:
            raise MoeError("; ".join(f"{key}: {message}" for key, message in problems))
        _attach_section(trainer, model, cfg, done)
        _attach_bias_balancing(trainer, model, cfg, done)
    if done:
        print0(f"hftrain: moe: {done}")
    return done


def _attach_section(trainer, model, cfg, done: dict) -> None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if cfg.aux_loss_coef or cfg.router_z_loss_coef:
        # The model returns router logits and its load-balancing loss (computed with the attention mask) as
        # `outputs.aux_loss`; it adds nothing to a loss because hftrain passes no labels (outputs.loss is None).
        base.config.get_text_config().output_router_logits = True  # a VLM's language model reads its own config
        tap = MaskTap(base)
        if cfg.aux_loss_coef:
            trainer.aux_losses["moe_aux_loss"] = (model_aux_loss, float(cfg.aux_loss_coef))
        if cfg.router_z_loss_coef:
            trainer.aux_losses["moe_z_loss"] = (
                lambda out: z_loss(out.router_logits, tap.flat(out.router_logits[0].shape[0])),
                float(cfg.router_z_loss_coef))
        done["aux_losses"] = sorted(k for k in trainer.aux_losses if k.startswith("moe_"))
    if cfg.expert_parallel_size > 1 or cfg.capacity_factor:
        done["expert_parallel"] = _expert_parallel(trainer, base, cfg)
    if cfg.router_health and routers(base):
        cb = RouterHealthCallback(base)
        trainer.add_callback(cb)  # its pop_logs() joins each training log (CommHookMixin.log)
        done["router_health"] = len(cb.layers)


def _attach_bias_balancing(trainer, model, cfg, done: dict) -> None:
    """Aux-loss-free balancing (balance.py): where moe.bias_update_rate asks for it, the same rule for every method
    (balance.resolved_rate; the run says which in one line, balance.balancing_line)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    rate = resolved_rate(cfg)
    if rate and biased_routers(base):
        balancer = BiasBalancer(base, rate)
        trainer.add_callback(balancer)
        done["bias_balancing"] = f"{len(balancer.routers)} routers, rate {rate}"


def _expert_parallel(trainer, model, cfg) -> str:
    n = cfg.expert_parallel_size
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        if n > 1 and trainer.is_deepspeed_enabled:
            raise MoeError("moe.expert_parallel_size: runs under strategy ddp or fsdp (ZeRO would shard or average "
                           "the per-rank experts); launch with accelerate_configs/ddp.yaml or fsdp.yaml, or set "
                           "expert_parallel_size: 1 and keep every expert on every rank")
        if n == 1 and (is_deepspeed_zero3_enabled() or trainer.is_fsdp_enabled):
            raise MoeError("moe.capacity_factor: needs the whole MoE block on each rank; not with ZeRO-3 / FSDP")
    world = trainer.args.world_size
    if n > 1 and n != world:
        raise MoeError(f"moe.expert_parallel_size: must equal the number of processes ({world}), got {n} "
                       "(expert-parallel groups inside data parallelism are not supported)")
    if n > 1 and trainer.is_fsdp_enabled and _offloads_parameters(trainer.accelerator.state.fsdp_plugin):
        raise MoeError(OFFLOAD_REFUSAL)
    group = dist.group.WORLD if n > 1 else None
    try:
        swapped = ep.parallelize(model, group, cfg.capacity_factor)
    except ValueError as e:
        raise MoeError(str(e)) from None
    trainer.add_callback(ep.ExpertParallelCallback(model))
    if trainer.is_fsdp_enabled:
        _leave_experts_to_their_ranks(trainer, model)
    return f"{swapped} blocks over {n} rank(s), capacity_factor {cfg.capacity_factor}"


# The launcher's FSDP config may offload where the recipe's strategy: section did not ask (config.strategy_rules
# refuses strategy.fsdp_offload_params with the same words).
OFFLOAD_REFUSAL = ("moe.expert_parallel_size: cannot run with FSDP's parameter offload (fsdp_offload_params): each "
                   "rank's experts stay on its GPU while the offloaded dense part is on the CPU, and the gradient "
                   "norm over both mixes CPU and GPU tensors; turn the offload off, or keep every expert on every rank "
                   "(expert_parallel_size: 1)")


def _offloads_parameters(plugin) -> bool:
    """accelerate's FSDP plugin: FSDP2's CPUOffloadPolicy, or FSDP1's CPUOffload(offload_params=True)."""
    policy = plugin.cpu_offload
    return type(policy).__name__ == "CPUOffloadPolicy" or bool(getattr(policy, "offload_params", False))


def _leave_experts_to_their_ranks(trainer, model) -> None:
    """Under FSDP2 the dense part is sharded and each rank's experts stay whole and its own: they are FSDP's ignored
    parameters (accelerate passes the plugin's ignored_modules to fully_shard), so FSDP neither shards nor averages
    them. accelerate reads the model's state dict while it shards; the experts are gathered for it first."""
    plugin = trainer.accelerator.state.fsdp_plugin
    plugin.ignored_modules = [*(plugin.ignored_modules or []), *(b.experts for b in ep.parallel_blocks(model))]
    ep.gather_for_save(model)
