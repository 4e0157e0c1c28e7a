"""The `distill:` section of a recipe (hftrain distill: distill.py, trainer.py read it) and its rules: its own
values, the options that apply to one mode only, where it runs, and at launch (this machine's files) whether the
teacher's tokenizer is the student's and their vocabulary sizes differ only by padding. config builds it as a field of
methods.Recipe and asks it for its rules (config.MethodSection)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ...config import MethodSection, ModelSection, Problems, Recipe, option
from ...config.fields import is_number
from ...config.mesh_rules import mesh_refusal
from .teacher_checks import teacher_problems

Mode = Literal["logits", "on_policy"]
Divergence = Literal["forward_kl", "reverse_kl", "jsd"]
# Options that apply to one mode only: key -> the mode.
MODE_ONLY = {"ce_weight": "logits", "lmbda": "on_policy", "max_new_tokens": "on_policy"}
DEFAULTS = {"ce_weight": 0.0, "lmbda": 1.0, "max_new_tokens": 64, "beta": 0.5}
# Where the teacher is placed as the student (methods/frozen.py FrozenModelsMixin) and the loss is tested exact;
# why not the others.
STRATEGIES = ("ddp", "fsdp", "zero3")
TEACHER_KEY = "distill.teacher"  # where the teacher sits in the recipe: every message about it names it
_WHOLE = ("the teacher would be whole on each rank (trl's prepare_deepspeed shards it under ZeRO-3 only) beside a "
          "student whose optimizer state is sharded, which is not tested: use zero3 (teacher sharded) or ddp")
_OFFLOAD = ("the teacher's DeepSpeed engine would offload its parameters as the student's (trl's prepare_deepspeed "
            "keeps offload_param), which is not tested: use zero3")
NOT_UNDER = {"zero1": _WHOLE, "zero2": _WHOLE, "zero3_offload": _OFFLOAD, "zero_infinity": _OFFLOAD}


@dataclass
class DistillSection(MethodSection):
    HELP = "Knowledge distillation (recipes/distill.py): a student taught by a frozen teacher's token distributions."

    teacher: ModelSection = option(help="The teacher: a model section (name_or_path, dtype, quantization, "
                                   "trust_remote_code), frozen; its tokenizer must be the student's.")
    mode: Mode = option("logits", "logits: the student learns the teacher's distributions on the dataset's "
                        "completions; on_policy: on completions the student samples for the dataset's prompts.")
    divergence: Divergence | None = option(
        None, "forward_kl (KL(teacher || student)), reverse_kl (KL(student || teacher)) or jsd (generalised "
        "Jensen-Shannon with distill.beta, GKD's); default forward_kl for logits, reverse_kl for on_policy.")
    beta: float | None = option(None, "jsd only: the teacher's weight in the mixture, in (0, 1); default 0.5.")
    temperature: float = option(1.0, "Both distributions are softmax(logits / temperature); on_policy samples at it.")
    ce_weight: float | None = option(
        None, "logits only: loss = divergence + ce_weight x cross-entropy on the completions; default 0.")
    lmbda: float | None = option(
        None, "on_policy only: the share of rows whose completions the student samples (GKD's lambda, drawn per row "
        "from the seed, the step and its tokens; the others keep the dataset's); default 1.")
    max_new_tokens: int | None = option(None, "on_policy only: tokens the student samples at most; default 64.")
    top_k: int | None = option(
        None, "Compare the distributions on the teacher's k most likely tokens only (both renormalised over them).")

    @property
    def method(self) -> str:
        return "distill"

    def value(self, key: str):
        """A mode option's value, its default where unset."""
        got = getattr(self, key)
        return DEFAULTS[key] if got is None else got

    @property
    def resolved_divergence(self) -> str:
        if self.divergence is not None:
            return self.divergence
        return "reverse_kl" if self.mode == "on_policy" else "forward_kl"

    def problems(self, recipe: Recipe) -> Problems:
        return _value_problems(self) + _recipe_problems(recipe)

    def strategy_problems(self, recipe: Recipe, strategy: str) -> Problems:
        out: Problems = []
        if strategy not in STRATEGIES:
            out.append(("strategy.name", f"distillation runs under {', '.join(STRATEGIES)} (where the teacher is "
                        f"placed as the student and the loss is tested exact), not '{strategy}': "
                        + NOT_UNDER.get(strategy, "launch with one of those accelerate_configs")))
        if strategy == "fsdp" and recipe.strategy.fsdp_offload_params is True:
            out.append(("strategy.fsdp_offload_params", "distillation under fsdp keeps parameters on the device: "
                        "the teacher would be offloaded too (trl's prepare_fsdp passes the offload policy on), which "
                        "is not tested: remove it, or use zero3"))
        sp = recipe.strategy.sequence_parallel
        if is_number(sp) and sp > 1:
            out.append(("strategy.sequence_parallel", "distillation does not run under sequence parallelism (the "
                        "teacher scores whole rows on each rank): remove strategy.sequence_parallel"))
        return out + mesh_refusal(recipe, "distillation")

    def launch_problems(self, recipe: Recipe, world: int, environment: bool) -> Problems:
        return teacher_problems(recipe) if environment else []


def _value_problems(d: DistillSection) -> Problems:
    """The section's own values, and the options that do not apply to its mode or divergence."""
    out: Problems = []
    for key, mode in MODE_ONLY.items():
        if getattr(d, key) is not None and d.mode in ("logits", "on_policy") and d.mode != mode:
            out.append((f"distill.{key}", f"applies to distill.mode: {mode}, not {d.mode}: remove it"))
    if d.beta is not None and d.resolved_divergence != "jsd":
        out.append(("distill.beta", f"applies to distill.divergence: jsd, not {d.resolved_divergence}: remove it"))
    if is_number(d.beta) and not 0 < d.beta < 1:
        out.append(("distill.beta", f"must be in (0, 1) (0 is forward_kl, 1 reverse_kl: say so), got {d.beta}"))
    if is_number(d.temperature) and not (math.isfinite(d.temperature) and d.temperature > 0):
        out.append(("distill.temperature", f"must be a finite number > 0, got {d.temperature}"))
    if is_number(d.ce_weight) and not (math.isfinite(d.ce_weight) and d.ce_weight >= 0):
        out.append(("distill.ce_weight", f"must be a finite number >= 0, got {d.ce_weight}"))
    if is_number(d.lmbda) and not 0 <= d.lmbda <= 1:
        out.append(("distill.lmbda", f"must be in [0, 1], got {d.lmbda}"))
    for key in ("max_new_tokens", "top_k"):
        if is_number(getattr(d, key)) and getattr(d, key) < 1:
            out.append((f"distill.{key}", f"must be at least 1, got {getattr(d, key)}"))
    return out


def _recipe_problems(recipe: Recipe) -> Problems:
    """What the rest of a distillation recipe may not ask for: the chunked or fused CE (the divergence needs the
    student's logits), sequence-averaged loss, MoE; on_policy: packed rows (prompts are cut from padded rows)."""
    out: Problems = []
    if recipe.training.get("loss_impl") in ("chunked", "fused"):
        out.append(("training.loss_impl", "distillation compares the student's logits with the teacher's (the "
                    "divergence is chunked over tokens already): remove it"))
    if recipe.training.get("loss_averaging") not in ("token", None):
        out.append(("training.loss_averaging", "distillation averages over the completion tokens of the global "
                    "batch: remove it"))
    if recipe.moe is not None:
        out.append(("moe", "is not supported with distillation: remove it"))
    d = recipe.data
    if recipe.distill.mode == "on_policy" and d is not None and getattr(d, "packing", False) is True:
        out.append(("data.packing", "on_policy samples completions for each row's prompt; packed rows have none "
                    "apart: remove it"))
    return out
