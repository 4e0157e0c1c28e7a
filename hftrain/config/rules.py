"""Rules across a recipe's sections: what each value must satisfy given the others, and which combinations of
strategy, compression, MoE, LoRA and optimizer can run. Each problem is (key as the user spells it, message with
the fix); nothing here reads the environment (launch.preflight does).
"""

from __future__ import annotations

import math

from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..constants import (ZERO_STAGE)
from .data_rules import data_problems
from .fields import is_number
from .strategy import STRATEGY_OPTIONS
from .strategy_rules import section_problems, strategy_problems
from .sections import (COMPRESSION_OPTIONS, CompressionSection, HubSection, LoraSection, MoeSection,
                       Problems, QuantizationSection, Recipe, StrategySection, UpcycleSection)

_num = is_number


def recipe_problems(recipe: Recipe) -> Problems:
    """Every rule that the recipe alone decides; with strategy.name set, its strategy's rules too. Values that
    already failed their type check are skipped."""
    out: Problems = []
    _training_ranges(recipe, out)
    _resume_weights_only(recipe, out)
    has_eval = data_problems(recipe, out)
    if recipe.typed_training.eval_strategy not in ("no", None) and not has_eval:
        out.append(("training.eval_strategy", "evaluation needs data: set data.eval_sources or data.eval_fraction"))
    if recipe.eval is not None and _num(recipe.eval.exact_match) and recipe.eval.exact_match < 0:
        out.append(("eval.exact_match", f"must be >= 0 (0: off), got {recipe.eval.exact_match}"))
    if recipe.eval is not None and _num(recipe.eval.exact_match) and recipe.eval.exact_match > 0 and not has_eval:
        out.append(("eval.exact_match", "needs held-out data: set data.eval_sources or data.eval_fraction"))
    if isinstance(recipe.compression, CompressionSection):
        _compression_problems(recipe.compression, out)
    if isinstance(recipe.moe, MoeSection):
        _moe_problems(recipe, out)
    lora = recipe.model.lora if recipe.model is not None else None
    if isinstance(lora, LoraSection) and _num(lora.r) and lora.r <= 0:
        out.append(("model.lora.r", f"must be > 0, got {lora.r}"))
    out += _loss_impl_problems(recipe)
    if recipe.model is not None and isinstance(recipe.model.quantization, QuantizationSection):
        out += quantization_problems(recipe)
    if isinstance(recipe.hub, HubSection):
        out += hub_problems(recipe.hub, lora)
    out += method_problems(recipe)
    if isinstance(recipe.strategy, StrategySection):
        out += section_problems(recipe.strategy)
    if isinstance(recipe.strategy, StrategySection) and recipe.strategy.name in STRATEGY_OPTIONS:
        out += strategy_problems(recipe, recipe.strategy.name)
    return out


def _loss_impl_problems(recipe: Recipe) -> Problems:
    """training.loss_impl chunked or fused against LoRA on lm_head; fused (liger-kernel's fused linear CE) against
    the sequence average it does not compute and against model.kernels: none, which turns liger's kernels off."""
    out: Problems = []
    impl, m = recipe.typed_training.loss_impl, recipe.model
    lora = m.lora if m is not None else None
    if isinstance(lora, LoraSection) and impl in ("chunked", "fused") and lora.reaches("lm_head"):
        key = "modules_to_save" if "lm_head" in (lora.modules_to_save or []) else "target_modules"
        out.append((f"model.lora.{key}", f"reaches lm_head, which training.loss_impl: {impl} cannot compute "
                    "through (a wrapped head); use training.loss_impl: auto or logits, or leave lm_head out"))
    if impl != "fused":
        return out
    if recipe.typed_training.loss_averaging != "token":
        out.append(("training.loss_impl", "fused (liger-kernel's fused linear cross-entropy) sums the token CE, every "
                    "target weighing 1, and cannot compute training.loss_averaging: sequence; set training.loss_impl: "
                    "chunked (the same loss, hftrain's own chunks) or loss_averaging: token"))
    if m is not None and m.kernels == "none":
        out.append(("training.loss_impl", "fused is liger-kernel's fused linear cross-entropy, and model.kernels: "
                    "none turns liger's kernels off; set training.loss_impl: chunked (hftrain's own chunks), or remove "
                    "model.kernels: none (model.kernels sets the layers; training.loss_impl the loss)"))
    return out


def method_problems(recipe: Recipe) -> Problems:
    """A recipe trains one method; the section of the one it holds checks its own rules (hftrain/methods/)."""
    sections = recipe.method_sections()
    first, *others = list(sections) or [None]
    out: Problems = [(name, f"a recipe trains one method: remove the {first}: section or this one") for name in others]
    for section in sections.values():
        out += section.problems(recipe)
    return out


# training: values that must be at least 1, and values that must be finite numbers in a range. TrainingArguments
# accepts all of these silently (a batch of 0 fails late, a learning rate of inf trains to NaN and exits 0).
_AT_LEAST_ONE = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
_RANGES = {  # name: (low, low inclusive, high, high inclusive, what)
    "learning_rate": (0.0, False, math.inf, False, "> 0"),
    "num_train_epochs": (0.0, False, math.inf, False, "> 0 (or set max_steps)"),
    "warmup_ratio": (0.0, True, 1.0, False, "in [0, 1)"),
    "weight_decay": (0.0, True, math.inf, False, ">= 0"),
    "max_grad_norm": (0.0, True, math.inf, False, ">= 0 (0 turns clipping off)"),
    "adam_epsilon": (0.0, False, math.inf, False, "> 0"),
}


def _resume_weights_only(recipe: Recipe, out: Problems) -> None:
    """training.resume_weights_only changes how a resume loads: it means nothing without one, and DeepSpeed restores
    optimizer and weights together (ZeRO's optimizer files hold the weights' partitions)."""
    if recipe.typed_training.resume_weights_only is not True:
        return
    if not recipe.typed_training.resume_from_checkpoint:
        out.append(("training.resume_weights_only", "is set but training.resume_from_checkpoint is not: set "
                    "resume_from_checkpoint (true, or a checkpoint's path) or remove resume_weights_only"))
    name = recipe.strategy.name if isinstance(recipe.strategy, StrategySection) else None
    if name in ZERO_STAGE:
        out.append(("training.resume_weights_only", f"cannot be used with strategy.name: {name}: DeepSpeed restores "
                    "the optimizer state with the weights (ZeRO's optimizer files hold the weights' partitions); "
                    "resume the whole checkpoint, or use strategy.name ddp or fsdp"))


def _training_ranges(recipe: Recipe, out: Problems) -> None:
    t = recipe.training
    for name in _AT_LEAST_ONE:
        v = t.get(name)
        if _num(v) and v < 1:
            out.append((f"training.{name}", f"must be at least 1, got {v}"))
    for name, (lo, lo_in, hi, hi_in, what) in _RANGES.items():
        v = t.get(name)
        if name == "num_train_epochs" and _num(t.get("max_steps")) and t["max_steps"] > 0:
            continue  # max_steps decides the length
        if _num(v) and not (math.isfinite(v) and (v >= lo if lo_in else v > lo) and (v <= hi if hi_in else v < hi)):
            out.append((f"training.{name}", f"must be a finite number {what}, got {v}"))
    steps = t.get("max_steps")
    if _num(steps) and (steps == 0 or steps < -1):
        out.append(("training.max_steps", f"must be > 0, or -1 to train num_train_epochs, got {steps} (0 would "
                    "still run a step)"))
    warm = t.get("warmup_steps")
    if _num(warm) and warm < 0:
        out.append(("training.warmup_steps", f"must be >= 0, got {warm}"))
    bad = t.get("max_bad_steps")
    if _num(bad) and bad < 0:
        out.append(("training.max_bad_steps", f"must be >= 0 (0: the first non-finite step stops the run), got {bad}"))
    if _num(bad) and bad > 0 and t.get("fp16") is True:
        out.append(("training.max_bad_steps", "cannot be used with training.fp16: its grad scaler already skips "
                    "steps with non-finite gradients; use bf16, or set max_bad_steps to 0"))


def _compression_problems(c: CompressionSection, out: Problems) -> None:
    for key, methods in COMPRESSION_OPTIONS.items():
        if getattr(c, key) is not None and c.method not in methods:
            out.append((f"compression.{key}", f"applies to method {' / '.join(methods)}, not '{c.method}': remove it"))
    if c.start_step is not None and c.method == "none":
        out.append(("compression.start_step", "applies only with a compression method: remove it"))
    if _num(c.start_step) and c.start_step < 0:
        out.append(("compression.start_step", f"must be >= 0, got {c.start_step}"))
    if c.method == "powersgd" and c.resolved_error_feedback() and _num(c.start_step) and c.start_step < 2:
        out.append(("compression.start_step", "must be >= 2 for powersgd with error feedback: DDP rebuilds its "
                    "buckets after the first step and PyTorch's PowerSGD keys its error by bucket"))
    if _num(c.powersgd_rank) and c.powersgd_rank < 1:
        out.append(("compression.powersgd_rank", f"must be >= 1, got {c.powersgd_rank}"))
    if _num(c.int8_chunk_size) and c.int8_chunk_size < 1:
        out.append(("compression.int8_chunk_size", f"must be >= 1, got {c.int8_chunk_size}"))
    if c.int8_chunk_size is not None and c.int8_granularity == "tensor":
        out.append(("compression.int8_chunk_size", "applies to int8_granularity chunk, not tensor: remove it"))
    if _num(c.topk_ratio) and not 0 < c.topk_ratio <= 1:
        out.append(("compression.topk_ratio", f"must be in (0, 1], got {c.topk_ratio}"))


# How hftrain's expert-parallel layer (moe/expert_parallel.py) runs the experts: a loop over the experts a rank holds.
EXPERT_PARALLEL_IMPLEMENTATION = "eager"


def _moe_problems(recipe: Recipe, out: Problems) -> None:
    m = recipe.moe
    for key in ("aux_loss_coef", "router_z_loss_coef"):
        v = getattr(m, key)
        if _num(v) and v < 0:
            out.append((f"moe.{key}", f"must be >= 0, got {v}"))
    if _num(m.capacity_factor) and m.capacity_factor <= 0:
        out.append(("moe.capacity_factor", f"must be > 0, got {m.capacity_factor}"))
    if _num(m.bias_update_rate) and m.bias_update_rate < 0:
        out.append(("moe.bias_update_rate", f"must be >= 0 (0: off), got {m.bias_update_rate}"))
    if isinstance(m.expert_parallel_size, int) and m.expert_parallel_size < 1:
        out.append(("moe.expert_parallel_size", f"must be >= 1, got {m.expert_parallel_size}"))
    parallel = isinstance(m.expert_parallel_size, int) and m.expert_parallel_size > 1
    if parallel and recipe.model is not None and recipe.model.lora is not None:
        out.append(("model.lora", "cannot be combined with moe.expert_parallel_size > 1 (each rank holds "
                    "different experts); train all weights"))
    impl = recipe.model.experts_implementation if recipe.model is not None else None
    if (parallel or _num(m.capacity_factor)) and impl not in (None, EXPERT_PARALLEL_IMPLEMENTATION):
        key = "moe.expert_parallel_size" if parallel else "moe.capacity_factor"
        out.append(("model.experts_implementation", f"'{impl}' is not used with {key}: the expert-parallel layer "
                    f"runs its experts itself, one after another ('{EXPERT_PARALLEL_IMPLEMENTATION}'); remove "
                    f"model.experts_implementation, or set it to '{EXPERT_PARALLEL_IMPLEMENTATION}'"))
    u = m.upcycle
    if isinstance(u, UpcycleSection):
        if isinstance(u.num_experts, int) and u.num_experts < 2:
            out.append(("moe.upcycle.num_experts", f"must be >= 2, got {u.num_experts}"))
        if isinstance(u.top_k, int) and isinstance(u.num_experts, int) and not 1 <= u.top_k <= u.num_experts:
            out.append(("moe.upcycle.top_k", f"must be in 1..num_experts ({u.num_experts}), got {u.top_k}"))
        if recipe.model is not None and recipe.model.lora is not None:
            out.append(("moe.upcycle", "cannot be combined with model.lora: the copied experts would stay frozen "
                        "and identical; train all weights, or upcycle with `hftrain moe upcycle` and put LoRA on "
                        "the result"))


def quantization_problems(recipe: Recipe) -> Problems:
    """model.quantization (QLoRA): a quantised base is frozen, so only an adapter trains; 4-bit-only keys are
    refused with bits 8 rather than ignored."""
    q, out = recipe.model.quantization, []
    if recipe.model.lora is None:
        out.append(("model.quantization", "a quantised base cannot be trained itself (its weights are packed "
                    "integers that no optimizer updates): add model.lora (QLoRA: the adapter trains, the base stays "
                    "frozen), or remove model.quantization to train all weights"))
    if q.bits == 8:
        for key in ("type", "double_quant", "storage_dtype"):
            if getattr(q, key) is not None:
                out.append((f"model.quantization.{key}", "applies to bits: 4 only (bitsandbytes' 8-bit layers have "
                            "no such setting); remove it, or set model.quantization.bits: 4"))
    if isinstance(recipe.moe, MoeSection) and recipe.moe.upcycle is not None:
        out.append(("moe.upcycle", "cannot copy a quantised base's layers into experts: upcycle the full-precision "
                    "model with `hftrain moe upcycle`, then quantise the result"))
    return out


def hub_problems(hub: HubSection, lora) -> Problems:
    """Rules of the `hub:` section (types are already checked)."""
    out: Problems = []
    if hub.push is True and not hub.repo_id:
        out.append(("hub.repo_id", "hub.push is true but no repository is named: set hub.repo_id: "
                    "your-name/model-name"))
    if isinstance(hub.repo_id, str) and hub.repo_id:
        msg = repo_id_problem(hub.repo_id)
        if msg:
            out.append(("hub.repo_id", msg))
    if hub.merge_lora is True and lora is None:
        out.append(("hub.merge_lora", "needs a LoRA run (model.lora); a full fine-tune is pushed as it is"))
    elif hub.merge_lora is True and getattr(lora, "merge", None) is False:
        out.append(("hub.merge_lora", "needs model.lora.merge: true, which writes the merged model to "
                    "output_dir/merged"))
    return out


def repo_id_problem(repo_id: str) -> str | None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        return f"{repo_id!r} is not a repository id ({str(e).splitlines()[0]}); write your-name/model-name"
    return None
