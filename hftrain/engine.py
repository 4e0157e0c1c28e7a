"""The strategy at run time: what the launcher set up, agreement with the recipe, and the per-run options.

The launcher (accelerate's config) decides processes and the engine family; the recipe's `strategy:` options
are applied on top, so `strategy.nvme_path=/mnt/nvme` works with a shipped config too: for ZeRO the DeepSpeed
config is re-rendered from the recipe and given to TrainingArguments; for FSDP the options go into the FSDP_*
variables accelerate reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

from .recipe import Recipe, StrategySection, accelerator_available
from .strategies import ZERO_STAGE, deepspeed_config

SHARDED = {"fsdp", "zero3", "zero3_offload", "zero_infinity"}  # no rank holds all parameters


class LaunchError(RuntimeError):
    pass


def _zero_name_from_json(cfg: dict) -> str:
    zero = cfg.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    if stage != 3:
        return f"zero{stage}"
    devices = {zero.get("offload_param", {}).get("device"), zero.get("offload_optimizer", {}).get("device")}
    return "zero_infinity" if "nvme" in devices else "zero3_offload" if "cpu" in devices else "zero3"


def launcher_strategy() -> str:
    """The strategy the launcher set up, read from the environment accelerate's launcher exports."""
    env = os.environ
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                return _zero_name_from_json(json.load(fh))
        return f"zero{env.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '')}"
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "fsdp"
    return "ddp"


def resolve_strategy(recipe: Recipe) -> StrategySection:
    """The recipe's strategy section with the name the launcher runs; a disagreement stops the run."""
    have = launcher_strategy()
    wanted = recipe.strategy.name
    if wanted is not None and wanted != have:
        raise LaunchError(
            f"{recipe.source}: strategy.name is '{wanted}' but the launcher set up '{have}'. Launch with "
            f"`--config_file accelerate_configs/{wanted}.yaml` (or `hftrain launch`), or set strategy.name to "
            f"'{have}', or remove strategy.name to let the launcher decide"
        )
    return checked_strategy(recipe, replace(recipe.strategy, name=have))


def checked_strategy(recipe: Recipe, strategy: StrategySection, world_size: int | None = None) -> StrategySection:
    """Preflight for a named strategy (shared by the run and `hftrain launch`): options that do not apply,
    optimizer rules, NVMe and async_io; ZeRO-Infinity's swap buffers sized to the largest parameter partition.
    All problems at once."""
    from .strategies import option_problems

    from .compression import problems as compression_problems

    problems = option_problems(strategy) + compression_problems(recipe.compression, strategy.name, recipe.training)
    optim = str(recipe.training.get("optim", "adamw_torch"))
    if strategy.name in ("zero3_offload", "zero_infinity") and not optim.startswith("adamw"):
        problems.append(("training.optim", f"'{optim}' cannot be used with '{strategy.name}': the optimizer states "
                         "live off the GPU and DeepSpeed's own AdamW updates them; use an adamw_* optim or zero3"))
    messages = [f"{recipe.source}: {k}: {m}" for k, m in problems]
    from .checkpoints import layout
    from .distributed import launcher_world_size
    from .preflight import facts_or_none, output_dir_problems, resume_problems, strategy_problems

    facts = facts_or_none(recipe.model.name_or_path, recipe.model.trust_remote_code) if (
        strategy.name == "zero_infinity") else None
    if facts is not None:
        from .plan import swap_buffer_elems

        # DeepSpeed's usual 1e8 and 1e9 elements pin GBs of RAM per rank whatever the model; sized to the largest
        # parameter partition the swap buffers of a 113M model on 2 ranks take ~55 MiB per rank and NVMe holds
        # the rest (bench/memory.py). DeepSpeed sizes its optimizer swap buffers to the largest sub-group.
        part = swap_buffer_elems(facts.largest_tensor, world_size or launcher_world_size())
        if strategy.buffer_size is None:
            strategy = replace(strategy, buffer_size=part)
        if strategy.sub_group_size is None:
            strategy = replace(strategy, sub_group_size=part)
    messages += [f"{recipe.source}: {m}" for m in strategy_problems(strategy, facts.params if facts else None)]
    messages += [f"{recipe.source}: {m}" for m in output_dir_problems(recipe.output_dir)]
    t = recipe.training
    now = layout(world_size or launcher_world_size(), t.get("per_device_train_batch_size", 8), t.get("gradient_accumulation_steps", 1),
                 strategy.name)
    messages += [f"{recipe.source}: {m}" for m in resume_problems(recipe.resume_from_checkpoint, recipe.output_dir, now)]
    if messages:
        raise LaunchError("\n  - ".join(["preflight found problems:", *messages]))
    return strategy


def training_arguments_kwargs(strategy: StrategySection, compression=None) -> dict:
    """TrainingArguments additions for the strategy; sets the FSDP_* environment and the CPU shims it needs.
    `compression` (the recipe's section) sets DeepSpeed's reduction dtype under ZeRO."""
    from .distributed import isolate_restart_attempt

    isolate_restart_attempt()  # before TrainingArguments starts torch.distributed
    if strategy.name in ZERO_STAGE:
        from .preflight import extensions_dir

        extensions_dir()  # DeepSpeed JIT-compiles its ops (cpu_adam, async_io) on first use, into this cache
        from .compression import zero_communication_dtype

        dtype = zero_communication_dtype(compression) if compression is not None else None
        return {"deepspeed": deepspeed_config(strategy, dtype)}
    if strategy.name == "fsdp":
        for key, env in (("fsdp_reshard_after_forward", "FSDP_RESHARD_AFTER_FORWARD"),
                         ("fsdp_offload_params", "FSDP_OFFLOAD_PARAMS")):
            value = getattr(strategy, key)
            if value is not None:
                os.environ[env] = str(value).lower()
        if strategy.fsdp_wrap_class:
            os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"] = strategy.fsdp_wrap_class
        if not accelerator_available():
            from .cpu_compat import apply_fsdp_on_cpu

            apply_fsdp_on_cpu()
    return {}


def after_training_arguments(strategy: StrategySection) -> None:
    """DeepSpeed's comm layer must exist before the model is built (ZeRO-3's zero.Init); on CPU it runs on gloo."""
    if strategy.name in ZERO_STAGE:
        import deepspeed

        from .deepspeed_fixes import share_fp32_master_with_fp32_weights

        deepspeed.init_distributed("nccl" if accelerator_available() else "gloo")
        share_fp32_master_with_fp32_weights()


def describe(trainer, strategy: StrategySection) -> dict:
    """What engine actually trained: for tests and for run_info.json."""
    wrapped = trainer.model_wrapped
    out = {"strategy": strategy.name, "wrapper": type(wrapped).__name__}
    if strategy.name in ZERO_STAGE:
        out["zero_stage"] = wrapped.zero_optimization_stage()
        out["offload_optimizer"] = str(getattr(wrapped.zero_offload_optimizer(), "device", None) or "none")
        out["offload_param"] = str(getattr(wrapped.zero_offload_param(), "device", None) or "none")
        out["communication_dtype"] = str(wrapped.communication_data_type)
        opt = wrapped.optimizer
        if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3: is the fp32 master its own copy of the weights?
            shared = all(a is b for a, b in zip(opt.fp32_partitioned_groups_flat, opt.fp16_partitioned_groups_flat))
            out["fp32_master"] = "the weights" if shared else "a copy"
    if strategy.name == "fsdp":
        from torch.distributed.fsdp import FSDPModule

        out["fsdp2_modules"] = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
        root = trainer.model if isinstance(trainer.model, FSDPModule) else None
        out["fsdp_reduce_dtype"] = str(root._get_fsdp_state()._mp_policy.reduce_dtype) if root is not None else None
    return out
