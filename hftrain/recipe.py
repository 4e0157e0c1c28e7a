"""The typed recipe: schema, YAML + command-line loading, validation.

Precedence is defaults < YAML < command line. Every problem found is collected and raised at once in a
`RecipeError`, each naming the key as the user spelled it, where it came from, and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from .schema import Ctx, build, check, type_name, unknown

STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload", "zero_infinity")


def _f(default=dataclasses.MISSING, help: str = "", factory=None):
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class LoraSection:
    r: int = _f(16, "LoRA rank.")
    alpha: int = _f(32, "LoRA alpha (the update is scaled by alpha / r).")
    dropout: float = _f(0.05, "Dropout on the LoRA input.")
    target_modules: str | list[str] = _f("all-linear", "Modules to adapt: a list of names, or 'all-linear'.")
    modules_to_save: list[str] | None = _f(None, "Modules trained fully and saved with the adapter (e.g. lm_head).")
    merge: bool = _f(False, "Also save base + adapter merged into a full model in output_dir/merged.")


@dataclass
class ModelSection:
    name_or_path: str = _f(help="Local folder or Hub id of the causal LM to fine-tune.")
    tokenizer_name_or_path: str | None = _f(None, "Tokenizer folder or Hub id; defaults to name_or_path.")
    revision: str | None = _f(None, "Hub revision (branch, tag or commit) of model and tokenizer.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _f("auto", "Dtype the weights are loaded in.")
    attn_implementation: str | None = _f(None, "Attention kernel: eager, sdpa, flash_attention_2, ...")
    trust_remote_code: bool = _f(False, "Run modelling code shipped with the checkpoint. Off unless you trust it.")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    lora: LoraSection | None = _f(None, "Train a LoRA adapter through peft instead of all weights.")


@dataclass
class DataSource:
    path: str = _f(help="A local file (.jsonl/.json/.parquet/.csv), a save_to_disk folder, or a Hub dataset id.")
    format: Literal["auto", "messages", "prompt_completion", "alpaca", "text"] = _f(
        "auto", "Example format; 'auto' detects it from the columns."
    )
    split: str = _f("train", "Split to read (Hub datasets and save_to_disk DatasetDicts).")
    name: str | None = _f(None, "Dataset configuration name (Hub datasets).")
    columns: dict[str, str] = _f(
        help="Rename map from hftrain's column name to yours, e.g. {messages: conversations}.", factory=dict
    )
    weight: float = _f(1.0, "Relative sampling weight when several sources are mixed.")


@dataclass
class DataSection:
    sources: list[DataSource] = _f(help="Training data: one or more sources.")
    eval_sources: list[DataSource] = _f(help="Held-out data for evaluation.", factory=list)
    eval_fraction: float = _f(0.0, "Fraction of each training source held out for evaluation (0 = none).")
    chat_template: str | None = _f(None, "Jinja chat template, or a path to a .jinja file, replacing the tokenizer's.")
    max_length: int = _f(2048, "Maximum tokens per example.")
    truncation: Literal["right", "drop"] = _f("right", "Longer examples: cut at max_length ('right') or 'drop' them.")
    packing: bool = _f(False, "Pack each batch into one row; position_ids restart per example so none attends another.")
    assistant_only_loss: bool = _f(True, "messages/alpaca: train on assistant tokens only.")
    completion_only_loss: bool = _f(True, "prompt_completion: train on completion tokens only.")
    skip_untrainable: bool = _f(False, "Drop examples left with no trainable token instead of stopping with an error.")
    num_proc: int | None = _f(None, "Processes for tokenisation (datasets.map).")


@dataclass
class StrategySection:
    name: Literal["ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload", "zero_infinity"] | None = _f(
        None, "How to distribute. Unset: the launcher's config decides; set: it must agree with the launcher."
    )
    num_processes: int | None = _f(None, "Processes in all (all machines); default 2.")
    num_machines: int | None = _f(None, "Machines (nodes); default 1.")
    machine_rank: int | None = _f(None, "This machine's rank among the machines; default 0.")
    main_process_ip: str | None = _f(None, "Address of machine 0 (several machines).")
    main_process_port: int | None = _f(None, "Port of the rendezvous on machine 0; default 29500.")
    fsdp_reshard_after_forward: bool | None = _f(None, "fsdp: free gathered parameters after forward (ZeRO-3 like); default true.")
    fsdp_offload_params: bool | None = _f(None, "fsdp: keep parameters and gradients on the CPU; default false.")
    fsdp_wrap_class: str | None = _f(None, "fsdp: layer class to shard as one unit; default: the model's own decoder layer.")
    pin_memory: bool | None = _f(None, "zero3_offload/zero_infinity: pin CPU buffers (GPU only); default false.")
    nvme_path: str | None = _f(None, "zero_infinity: folder on a fast local disk for parameter and optimizer swap.")
    aio_block_size: int | None = _f(None, "zero_infinity: async I/O block size in bytes; default 1048576.")
    aio_queue_depth: int | None = _f(None, "zero_infinity: async I/O queue depth; default 8.")
    buffer_count: int | None = _f(None, "zero_infinity: swap buffers for parameters; default 5.")
    buffer_size: int | None = _f(None, "zero_infinity: elements per parameter swap buffer; default: the largest parameter.")
    sub_group_size: int | None = _f(
        None, "zero_infinity: optimizer elements swapped as one unit (each of the optimizer's swap buffers holds "
        "one); default: 4x the largest parameter."
    )


@dataclass
class EvalSection:
    exact_match: int = _f(
        0, "Greedy-generate answers for this many held-out examples and report exact-match accuracy before and after training."
    )
    max_new_tokens: int = _f(32, "Generation length for exact_match.")


@dataclass
class CompressionSection:
    method: Literal["none", "fp16", "bf16", "powersgd", "int8", "topk"] = _f(
        "none", "Gradient compression on the data-parallel reduction. ddp: all methods; fsdp and zero1-3: fp16/bf16."
    )
    start_step: int | None = _f(
        None, "Optimizer steps with uncompressed gradients first; default 2 for powersgd (its error feedback needs "
        "DDP's rebuilt buckets), else 0."
    )
    error_feedback: bool | None = _f(
        None, "powersgd/int8/topk: add what the last step did not send to this step's gradient; default true."
    )
    powersgd_rank: int | None = _f(None, "powersgd: rank of the low-rank approximation; default 4.")
    int8_granularity: Literal["chunk", "tensor"] | None = _f(
        None, "int8: one scale per chunk of int8_chunk_size elements, or one per bucket ('tensor'); default chunk."
    )
    int8_chunk_size: int | None = _f(None, "int8: elements per scale with granularity chunk; default 2048.")
    topk_ratio: float | None = _f(None, "topk: share of gradient elements sent each step; default 0.01.")

    def resolved_start_step(self) -> int:
        return self.start_step if self.start_step is not None else (2 if self.method == "powersgd" else 0)

    def resolved_error_feedback(self) -> bool:
        return True if self.error_feedback is None else self.error_feedback

    def resolved_powersgd_rank(self) -> int:
        return self.powersgd_rank or 4

    def resolved_topk_ratio(self) -> float:
        return self.topk_ratio if self.topk_ratio is not None else 0.01

    def resolved_int8(self) -> tuple[str, int]:
        return self.int8_granularity or "chunk", self.int8_chunk_size or 2048


# Which compression options apply to which method (anything else set is an error, not ignored).
COMPRESSION_OPTIONS = {
    "error_feedback": ("powersgd", "int8", "topk"),
    "powersgd_rank": ("powersgd",),
    "int8_granularity": ("int8",),
    "int8_chunk_size": ("int8",),
    "topk_ratio": ("topk",),
}


@dataclass
class HubSection:
    push: bool = _f(False, "After training, validate output_dir and upload it to the Hub (main process; `hftrain push` "
                    "does the same for a finished run). The token comes from HF_TOKEN or `hf auth login`.")
    repo_id: str | None = _f(None, "Target repository, e.g. your-name/model-name (created if missing).")
    private: bool = _f(False, "Create the repository private (an existing repository keeps its visibility).")
    revision: str | None = _f(None, "Branch to push to, created if missing; default: main.")
    commit_message: str | None = _f(None, "Commit message; default: 'hftrain: upload <output_dir>'.")
    merge_lora: bool = _f(False, "LoRA runs: push base + adapter merged into a full model (needs model.lora.merge) "
                          "instead of the adapter alone.")
    license: str | None = _f(None, "License id for the model card, e.g. apache-2.0 (the base model's terms apply).")


@dataclass
class UpcycleSection:
    num_experts: int = _f(8, "Experts per upcycled layer (copies of the dense MLP).")
    top_k: int = _f(2, "Experts each token is routed to.")
    layers: list[int] | None = _f(None, "Decoder layers to upcycle (0-based); default all. Mixtral needs all.")
    router_init_std: float | None = _f(None, "Std of the routers' random init; default the model's initializer_range.")


@dataclass
class MoeSection:
    upcycle: UpcycleSection | None = _f(
        None, "Turn the dense model into its native MoE counterpart (Llama/Mistral -> Mixtral, Qwen2 -> Qwen2-MoE) "
        "before training; outputs are unchanged at step 0."
    )
    aux_loss_coef: float = _f(0.0, "Weight of the router load-balancing loss (0 = off); exact over ranks and accumulation.")
    router_z_loss_coef: float = _f(0.0, "Weight of the router z-loss (0 = off).")
    router_health: bool = _f(True, "Log per-layer expert load and router entropy; plot expert_load.png.")
    expert_parallel_size: int = _f(
        1, "Place the experts across this many ranks (all_to_all dispatch); must equal the number of processes; "
        "DDP only, Mixtral-style blocks."
    )
    capacity_factor: float | None = _f(
        None, "Each expert takes at most ceil(factor * tokens * top_k / experts) of a rank's assignments; the rest "
        "are dropped (logged as moe/dropped_tokens). Unset: no dropping."
    )


# Keys of `training:` that hftrain adds to TrainingArguments' own: (type, default, help).
HFTRAIN_TRAINING_KEYS: dict[str, tuple[Any, Any, str]] = {
    "loss_averaging": (
        Literal["token", "sequence"],
        "token",
        "token: mean CE over every target token of the global batch; sequence: mean over all sequences of the "
        "global batch of each sequence's mean CE. Both exact whatever the world size and accumulation.",
    ),
}
# hftrain's defaults for TrainingArguments fields, overridden by the recipe's `training:` section.
TRAINING_DEFAULTS: dict[str, Any] = {
    "output_dir": "runs/hftrain",
    "report_to": ["tensorboard"],
    "logging_steps": 10,
    "save_strategy": "steps",
    "save_steps": 500,
    "save_total_limit": 2,
    # All parameters take part in every step of a causal LM; True costs an extra all-reduce per step.
    "ddp_find_unused_parameters": False,
    **{k: v[1] for k, v in HFTRAIN_TRAINING_KEYS.items()},
}
# TrainingArguments fields the recipe owns elsewhere, or must never hold.
TRAINING_REFUSED = {
    "push_to_hub": "set hub.push: true and hub.repo_id: hftrain validates the folder before it uploads it",
    "hub_token": "the Hub token is read from HF_TOKEN or `hf auth login`, never from a recipe (it would be saved with the run)",
    "gradient_checkpointing": "set model.gradient_checkpointing instead",
    "activation_checkpointing": "set model.gradient_checkpointing instead",
    "average_tokens_across_devices": "hftrain always normalises the loss over the global batch (training.loss_averaging)",
    "use_liger_kernel": "Liger's fused loss returns no logits and bypasses hftrain's loss normalisation",
    "deepspeed": "set strategy.name (zero1 ... zero_infinity) and its options: hftrain generates the DeepSpeed "
    "config, with every value TrainingArguments owns as \"auto\" so that nothing rescales the loss twice",
    "fsdp": "set strategy.name: fsdp and its options (strategy.fsdp_*)",
    "fsdp_config": "set strategy.name: fsdp and its options (strategy.fsdp_*)",
}


@dataclass
class Recipe:
    model: ModelSection
    data: DataSection
    training: dict[str, Any] = field(default_factory=dict, metadata={"help": "TrainingArguments fields."})
    strategy: StrategySection = field(default_factory=StrategySection, metadata={"help": "Distribution strategy."})
    eval: EvalSection = field(default_factory=EvalSection, metadata={"help": "Generation-based evaluation."})
    compression: CompressionSection = field(default_factory=CompressionSection,
                                            metadata={"help": "Gradient compression."})
    hub: HubSection = field(default_factory=HubSection, metadata={"help": "Push the validated result to the Hub."})
    moe: MoeSection | None = field(default=None, metadata={"help": "Mixture of experts: upcycling, aux losses."})
    source: str = field(default="<dict>", metadata={"help": "Where the recipe was read from.", "internal": True})

    @property
    def output_dir(self) -> str:
        return self.training["output_dir"]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def training_arguments(self, **extra):
        """TrainingArguments from the `training:` section (this also sets up torch.distributed).

        `extra` are the strategy's additions (e.g. the DeepSpeed config), see hftrain.engine."""
        from transformers import TrainingArguments

        skip = {"resume_from_checkpoint", *HFTRAIN_TRAINING_KEYS}
        kwargs = {k: v for k, v in self.training.items() if k not in skip}
        kwargs.update(extra)
        kwargs["activation_checkpointing"] = self.model.gradient_checkpointing
        if "include_num_input_tokens_seen" not in kwargs:
            # With packing there is no attention_mask and pad may equal eos: count every token.
            kwargs["include_num_input_tokens_seen"] = "all" if self.data.packing else "non_padding"
        if "eval_on_start" not in kwargs and (self.data.eval_sources or self.data.eval_fraction > 0):
            # The "before" eval loss. It must come from inside train(): a trainer.evaluate() before train() marks
            # the model prepared, and train() then skips the DDP wrap (transformers 5.23 / accelerate 1.15), so each
            # rank silently trains its own copy.
            kwargs["eval_on_start"] = True
        if "use_cpu" not in kwargs and not accelerator_available():
            # Without it a GPU-less multi-process launch silently trains world-size-1 copies (FEASIBILITY.md).
            kwargs["use_cpu"] = True
        return TrainingArguments(**kwargs)

    @property
    def resume_from_checkpoint(self) -> str | bool | None:
        return self.training.get("resume_from_checkpoint")


def accelerator_available() -> bool:
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()


class RecipeError(ValueError):
    """All problems of one recipe, reported together."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        n = len(problems)
        super().__init__(f"{n} problem{'s' if n > 1 else ''} in the recipe:\n" + "\n".join(f"  - {p}" for p in problems))


# ----------------------------------------------------------------------------------------------------------------
# Loading


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node: Any = tree
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            idx = int(part)
            while len(node) <= idx:
                node.append({})
            node = node[idx]
            continue
        if part not in node or not isinstance(node[part], (dict, list)):
            node[part] = [] if nxt.isdigit() else {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        idx = int(last)
        while len(node) <= idx:
            node.append({})
        node[idx] = value
    else:
        node[last] = value


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """`section.key=value`, `--section.key value` and `--section.key=value`; values are parsed as YAML scalars."""
    out, problems, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            body = a[2:]
            if "=" in body:
                key, raw = body.split("=", 1)
            elif i + 1 < len(args):
                key, raw = body, args[i + 1]
                i += 1
            else:
                problems.append(f"command line: '{a}' has no value; write {body}=VALUE")
                i += 1
                continue
        elif "=" in a:
            key, raw = a.split("=", 1)
        else:
            problems.append(f"command line: '{a}' is not an override; write section.key=value (e.g. training.max_steps=10)")
            i += 1
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        out.append((key, value))
        i += 1
    if problems:
        raise RecipeError(problems)
    return out


def read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise RecipeError([f"{path}: recipe file not found"])
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise RecipeError([f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8"]) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        raise RecipeError([f"{where}: YAML syntax error: {getattr(e, 'problem', None) or e}"]) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError([f"{path}: a recipe is a mapping of sections (model:, data:, training:, ...), got {type(raw).__name__}"])
    return raw


def load_recipe(path: str | None, overrides: list[str] | None = None, raw: dict | None = None) -> Recipe:
    """Read a recipe file (or `raw` dict), apply command-line overrides, validate everything."""
    tree = read_yaml(path) if path is not None else dict(raw or {})
    source = path or "<dict>"
    origins: dict[str, str] = {}
    for key, value in parse_overrides(overrides or []):
        try:
            _set_dotted(tree, key, value)
        except (ValueError, TypeError, AttributeError):
            raise RecipeError([f"command line: cannot set '{key}'"]) from None
        origins[key] = "command line"
    return validate(tree, source, origins)


def load_from_argv(argv: list[str]) -> Recipe:
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        raise RecipeError(["usage: <recipe.yaml> [section.key=value ...] (the recipe path comes first)"])
    return load_recipe(argv[0], argv[1:])


# ----------------------------------------------------------------------------------------------------------------
# Validation


def _training_fields() -> tuple[dict[str, Any], set[str]]:
    from transformers import TrainingArguments

    hints = typing.get_type_hints(TrainingArguments)
    names = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    return hints, names


def _validate_training(raw: dict, ctx: Ctx) -> dict:
    hints, names = _training_fields()
    merged = dict(TRAINING_DEFAULTS)
    for name, value in raw.items():
        key = f"training.{name}"
        if name in TRAINING_REFUSED:
            ctx.add(key, f"not accepted here: {TRAINING_REFUSED[name]}")
            continue
        if name not in names and name not in HFTRAIN_TRAINING_KEYS:
            unknown(key, str(name), sorted((names | set(HFTRAIN_TRAINING_KEYS)) - set(TRAINING_REFUSED)), ctx)
            continue
        tp = HFTRAIN_TRAINING_KEYS[name][0] if name in HFTRAIN_TRAINING_KEYS else hints.get(name, Any)
        if name == "resume_from_checkpoint":
            tp = str | bool | None  # true = the newest checkpoint in output_dir
        ok, conv = check(value, tp, key, ctx)
        if not ok:
            ctx.add(key, f"expected {type_name(tp)}, got {value!r}")
        merged[name] = conv
    if not isinstance(merged.get("output_dir"), str) or not merged["output_dir"]:
        ctx.add("training.output_dir", "must be a folder path")
    return merged


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _validate_semantics(recipe: Recipe, ctx: Ctx) -> None:
    """Cross-field rules; values that already failed their type check are skipped."""
    d = recipe.data
    has_eval = False
    if d is not None:
        if isinstance(d.sources, list) and len(d.sources) == 0:
            ctx.add("data.sources", "needs at least one source, e.g. [{path: data/train.jsonl}]")
        if _num(d.eval_fraction) and not 0.0 <= d.eval_fraction < 1.0:
            ctx.add("data.eval_fraction", f"must be in [0, 1), got {d.eval_fraction}")
        has_eval = (_num(d.eval_fraction) and d.eval_fraction > 0) or bool(d.eval_sources)
        if _num(d.eval_fraction) and d.eval_fraction > 0 and d.eval_sources:
            ctx.add("data.eval_fraction", "set either data.eval_fraction or data.eval_sources, not both")
        if _num(d.max_length) and d.max_length < 2:
            ctx.add("data.max_length", f"must be at least 2, got {d.max_length}")
        for i, s in enumerate(d.sources if isinstance(d.sources, list) else []):
            if isinstance(s, DataSource) and _num(s.weight) and s.weight <= 0:
                ctx.add(f"data.sources.{i}.weight", f"must be > 0, got {s.weight}")
    t = recipe.training
    if t.get("eval_strategy", "no") not in ("no", None) and not has_eval:
        ctx.add("training.eval_strategy", "evaluation needs data: set data.eval_sources or data.eval_fraction")
    if recipe.eval is not None and _num(recipe.eval.exact_match) and recipe.eval.exact_match > 0 and not has_eval:
        ctx.add("eval.exact_match", "needs held-out data: set data.eval_sources or data.eval_fraction")
    if isinstance(recipe.strategy, StrategySection):
        from .strategies import option_problems

        for key, msg in option_problems(recipe.strategy):
            ctx.add(key, msg)
    if isinstance(recipe.compression, CompressionSection):
        _validate_compression(recipe.compression, ctx)
    if isinstance(recipe.moe, MoeSection):
        _validate_moe(recipe, ctx)
    lora = recipe.model.lora if recipe.model is not None else None
    if isinstance(lora, LoraSection) and _num(lora.r) and lora.r <= 0:
        ctx.add("model.lora.r", f"must be > 0, got {lora.r}")
    if isinstance(recipe.hub, HubSection):
        from .hub import option_problems as hub_problems

        for key, msg in hub_problems(recipe.hub, lora):
            ctx.add(key, msg)


def _refuse_hub_token(raw: dict, ctx: Ctx) -> dict:
    for name in ("token", "hub_token"):
        if name in raw:
            ctx.add(f"hub.{name}", "not accepted here: " + TRAINING_REFUSED["hub_token"])
    return {k: v for k, v in raw.items() if k not in ("token", "hub_token")}


def _validate_compression(c: CompressionSection, ctx: Ctx) -> None:
    for key, methods in COMPRESSION_OPTIONS.items():
        if getattr(c, key) is not None and c.method not in methods:
            ctx.add(f"compression.{key}", f"applies to method {' / '.join(methods)}, not '{c.method}': remove it")
    if c.start_step is not None and c.method == "none":
        ctx.add("compression.start_step", "applies only with a compression method: remove it")
    if _num(c.start_step) and c.start_step < 0:
        ctx.add("compression.start_step", f"must be >= 0, got {c.start_step}")
    if (c.method == "powersgd" and c.resolved_error_feedback() and _num(c.start_step) and c.start_step < 2):
        ctx.add("compression.start_step", "must be >= 2 for powersgd with error feedback: DDP rebuilds its buckets "
                "after the first step and PyTorch's PowerSGD keys its error by bucket")
    if _num(c.powersgd_rank) and c.powersgd_rank < 1:
        ctx.add("compression.powersgd_rank", f"must be >= 1, got {c.powersgd_rank}")
    if _num(c.int8_chunk_size) and c.int8_chunk_size < 1:
        ctx.add("compression.int8_chunk_size", f"must be >= 1, got {c.int8_chunk_size}")
    if c.int8_chunk_size is not None and c.int8_granularity == "tensor":
        ctx.add("compression.int8_chunk_size", "applies to int8_granularity chunk, not tensor: remove it")
    if _num(c.topk_ratio) and not 0 < c.topk_ratio <= 1:
        ctx.add("compression.topk_ratio", f"must be in (0, 1], got {c.topk_ratio}")


def _validate_moe(recipe: Recipe, ctx: Ctx) -> None:
    m = recipe.moe
    for key in ("aux_loss_coef", "router_z_loss_coef"):
        v = getattr(m, key)
        if _num(v) and v < 0:
            ctx.add(f"moe.{key}", f"must be >= 0, got {v}")
    if _num(m.capacity_factor) and m.capacity_factor <= 0:
        ctx.add("moe.capacity_factor", f"must be > 0, got {m.capacity_factor}")
    if isinstance(m.expert_parallel_size, int) and m.expert_parallel_size < 1:
        ctx.add("moe.expert_parallel_size", f"must be >= 1, got {m.expert_parallel_size}")
    if isinstance(m.expert_parallel_size, int) and m.expert_parallel_size > 1:
        why = "with moe.expert_parallel_size > 1 (each rank holds different experts)"
        if isinstance(recipe.strategy, StrategySection) and recipe.strategy.name not in (None, "ddp"):
            ctx.add("moe.expert_parallel_size", f"runs under strategy ddp only, not {recipe.strategy.name!r}: ZeRO and "
                    "FSDP would shard or average the per-rank experts. Use strategy.name: ddp, or keep every expert "
                    "on every rank (expert_parallel_size: 1) with ZeRO-3 (MoE blocks are made leaf modules)")
        if recipe.training.get("max_grad_norm", 1.0) not in (0, 0.0, None):
            ctx.add("training.max_grad_norm", f"set it to 0 {why}: the clipping norm would differ between ranks "
                    "and the replicated weights would drift apart")
        if recipe.training.get("resume_from_checkpoint"):
            ctx.add("training.resume_from_checkpoint", f"cannot resume {why}: checkpoints hold the optimizer "
                    "state of rank 0's experts only")
        if recipe.eval is not None and _num(recipe.eval.exact_match) and recipe.eval.exact_match > 0:
            ctx.add("eval.exact_match", f"set it to 0 {why}: generation lengths differ between ranks and the "
                    "expert all_to_all needs every rank in every forward")
        if recipe.model is not None and recipe.model.lora is not None:
            ctx.add("model.lora", f"cannot be combined {why}; train all weights")
    u = m.upcycle
    if isinstance(u, UpcycleSection):
        if isinstance(u.num_experts, int) and u.num_experts < 2:
            ctx.add("moe.upcycle.num_experts", f"must be >= 2, got {u.num_experts}")
        if isinstance(u.top_k, int) and isinstance(u.num_experts, int) and not 1 <= u.top_k <= u.num_experts:
            ctx.add("moe.upcycle.top_k", f"must be in 1..num_experts ({u.num_experts}), got {u.top_k}")
        if recipe.model is not None and recipe.model.lora is not None:
            ctx.add("moe.upcycle", "cannot be combined with model.lora: the copied experts would stay frozen and "
                    "identical; train all weights, or upcycle with `hftrain moe upcycle` and put LoRA on the result")


def validate(tree: dict, source: str = "<dict>", origins: dict[str, str] | None = None) -> Recipe:
    ctx = Ctx(source, origins or {})
    sections = {
        "model": ModelSection,
        "data": DataSection,
        "training": dict,
        "strategy": StrategySection,
        "eval": EvalSection,
        "compression": CompressionSection,
        "hub": HubSection,
        "moe": MoeSection,
    }
    built: dict[str, Any] = {}
    for name, value in tree.items():
        if name not in sections:
            unknown(str(name), str(name), list(sections), ctx)
            continue
        if value is None and name == "moe":  # an optional section, written as `moe: null` by to_yaml
            continue
        if not isinstance(value, dict):
            ctx.add(name, f"expected a mapping of keys, got {value!r}")
            continue
        if name == "training":
            built[name] = _validate_training(value, ctx)
        elif name == "hub":
            built[name] = build(HubSection, _refuse_hub_token(value, ctx), name, ctx)
        else:
            built[name] = build(sections[name], value, name, ctx)
    for name in ("model", "data"):
        if name not in tree:
            ctx.add(name, "required section is missing")
    built.setdefault("training", dict(TRAINING_DEFAULTS))
    built.setdefault("strategy", StrategySection())
    built.setdefault("eval", EvalSection())
    built.setdefault("compression", CompressionSection())
    built.setdefault("hub", HubSection())
    recipe = Recipe(
        model=built.get("model"),
        data=built.get("data"),
        training=built["training"],
        strategy=built["strategy"] or StrategySection(),
        eval=built["eval"] or EvalSection(),
        compression=built["compression"] or CompressionSection(),
        hub=built["hub"] or HubSection(),
        moe=built.get("moe"),
        source=source,
    )
    _validate_semantics(recipe, ctx)
    if ctx.problems:
        raise RecipeError(ctx.problems)
    return recipe
