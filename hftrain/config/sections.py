"""The recipe's sections as typed dataclasses: each field's type, default and help, and nothing that runs.

`loading.py` builds them from YAML and the command line, `rules.py` checks them against each other.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from ..constants import REDUCE_DTYPES, CompressionMethod, DataLayout
from .fields import option
from .eval_sections import EvalSection
from .schema import origin_of
from .strategy import StrategySection
from .training import TrainingValues, training_value, typed_values


@dataclass
class LoraSection:
    r: int = option(16, "LoRA rank.")
    alpha: int = option(32, "LoRA alpha (the update is scaled by alpha / r).")
    dropout: float = option(0.05, "Dropout on the LoRA input.")
    target_modules: str | list[str] = option("all-linear", "Modules to adapt: a list of names, or 'all-linear'.")
    modules_to_save: list[str] | None = option(None, "Modules trained fully and saved with the adapter (e.g. lm_head).")
    target_parameters: list[str] | None = option(
        None, "Parameters to adapt where they are no Linear module (peft's target_parameters), e.g. an MoE model's "
        "fused experts: [experts.gate_up_proj, experts.down_proj]; merged like the others.")
    merge: bool = option(False, "Also save base + adapter merged into a full model in output_dir/merged.")
    vision_parts: list[str] = option(
        help="Image-text-to-text models: parts beside the language model that get adapters too, [projector] and/or "
        "vision_tower (as model.freeze names them); by default the language model alone is adapted. Needs "
        "target_modules: all-linear.", factory=list)

    def reaches(self, module: str) -> bool:
        """Whether target_modules or modules_to_save reach the top-level module `module` (lm_head) as peft matches
        them: a name in a list; a string other than all-linear (which leaves the output layer out) as a regular
        expression the whole name must match (re.fullmatch). A pattern `.*` reached lm_head past the list check."""
        lists = [v for v in (self.target_modules, self.modules_to_save) if isinstance(v, list)]
        if any(module in v for v in lists):
            return True
        pattern = self.target_modules
        if not isinstance(pattern, str) or pattern == "all-linear":
            return False
        try:
            return re.fullmatch(pattern, module) is not None
        except re.error:  # peft refuses it (launch.model_libraries.lora_problems)
            return False


@dataclass
class QuantizationSection:
    """A base loaded quantised by bitsandbytes (QLoRA): passed to transformers' BitsAndBytesConfig."""
    bits: Literal[4, 8] = option(4, "4 (QLoRA's 4-bit base) or 8 (LLM.int8, which also quantises activations).")
    type: Literal["nf4", "fp4"] | None = option(None, "4-bit data type; default nf4 (bits 4 only).")
    double_quant: bool | None = option(None, "Quantise the quantisation constants too (bits 4 only); default true.")
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "Dtype the 4-bit layers compute in; auto: model.dtype (float32 where that is auto too).")
    storage_dtype: Literal["uint8", "float32", "bfloat16", "float16"] | None = option(
        None, "Dtype the packed 4-bit weights are stored in (bits 4 only); default uint8. FSDP and ZeRO-3 need it "
        "equal to the dtype they compute in (float32, or bfloat16 / float16 with training.bf16 / fp16).")


@dataclass
class ModelSection:
    name_or_path: str = option(help="Local folder or Hub id of the causal LM to fine-tune.")
    tokenizer_name_or_path: str | None = option(None, "Tokenizer folder or Hub id; defaults to name_or_path.")
    revision: str | None = option(None, "Hub revision (branch, tag or commit) of model and tokenizer.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option("auto", "Dtype the weights are loaded in.")
    attn_implementation: str | None = option(None, "Attention kernel: eager, sdpa, flash_attention_2, ...")
    trust_remote_code: bool = option(False, "Run modelling code shipped with the checkpoint. Off unless you trust it.")
    gradient_checkpointing: bool = option(False, "Recompute activations in backward to save memory.")
    lora: LoraSection | None = option(None, "Train a LoRA adapter through peft instead of all weights.")
    quantization: QuantizationSection | None = option(
        None, "Load the base quantised by bitsandbytes (QLoRA), e.g. {bits: 4, type: nf4}; needs model.lora.")
    kernels: Literal["liger", "none"] | None = option(
        None, "The model's layers only (the loss is training.loss_impl's): liger (liger-kernel's RMSNorm, RoPE, "
        "SwiGLU; CUDA only), none (the model's own layers, and no liger kernel anywhere: training.loss_impl: fused "
        "is refused with it); unset: liger's layers where they can run (CUDA, installed, the family supported)")
    experts_implementation: Literal["eager", "batched_mm", "grouped_mm"] | None = option(
        None, "MoE models: how transformers runs the experts (eager: a loop over the experts hit; batched_mm; "
        "grouped_mm); default: transformers' choice (grouped_mm where torch has it). bench/moe.py impl times them.")
    freeze: list[str] = option(
        help="Image-text-to-text models: parts left untrained, e.g. [vision_tower, projector] (LLaMA-Factory's "
        "freeze_vision_tower / freeze_multi_modal_projector); [vision_tower, language_model]: the projector alone.",
        factory=list)
    part_learning_rates: dict[str, float] = option(
        help="Image-text-to-text models: a learning rate per part (vision_tower, projector, language_model), e.g. "
        "{vision_tower: 2.0e-6}; the others at training.learning_rate, all under its schedule.", factory=dict)


@dataclass
class DataSource:
    path: str = option(help="A local file (.jsonl/.json/.parquet/.csv), a save_to_disk folder, or a Hub dataset id.")
    format: Literal["auto", DataLayout] = option(
        "auto", "Layout of the rows (messages, sharegpt, prompt_completion, alpaca, text); 'auto' detects it from the "
        "columns."
    )
    split: str = option("train", "Split to read (Hub datasets and save_to_disk DatasetDicts).")
    name: str | None = option(None, "Dataset configuration name (Hub datasets).")
    columns: dict[str, str] = option(
        help="Rename map from hftrain's column name to yours, e.g. {messages: conversations}.", factory=dict
    )
    roles: dict[str, str] = option(
        help="Role map from your role names to hftrain's (system, user, assistant, tool, function_call), e.g. "
        "{human: user, bot: assistant}.", factory=dict
    )
    weight: float = option(1.0, "Relative sampling weight when several sources are mixed.")


@dataclass
class DataSection:
    sources: list[DataSource] = option(help="Training data: one or more sources.")
    eval_sources: list[DataSource] = option(help="Held-out data for evaluation.", factory=list)
    eval_fraction: float = option(0.0, "Fraction of each training source held out for evaluation (0 = none).")
    chat_template: str | None = option(
        None, "Jinja chat template, a path to a .jinja file, or trl:NAME for one TRL ships (trl:qwen2_5, "
        "trl:qwen3_training, ...), replacing the tokenizer's.")
    chat_template_kwargs: dict[str, Any] = option(
        help="Extra variables for every chat template rendering, e.g. {enable_thinking: false} (Qwen3) or "
        "{date_string: 26 Jul 2024} (Llama 3; a template's today's date is pinned to 26 Jul 2024 otherwise).",
        factory=dict,
    )
    max_length: int = option(2048, "Maximum tokens per example.")
    truncation: Literal["right", "drop"] = option(
        "right", "Longer examples: cut at max_length ('right') or 'drop' them.")
    packing: bool = option(
        False, "Pack each batch into rows no longer than its longest example; position_ids restart per "
                               "example so none attends another.")
    image_min_pixels: int | None = option(None, "Image rows: the fewest pixels an image is resized to (aspect kept) by "
                                          "the processor (Qwen-VL: 28 x 28 pixels a token); default: the processor's.")
    image_max_pixels: int | None = option(None, "Image rows: the most pixels an image is resized to, capping its "
                                          "tokens (e.g. 589824 = 768 x 768); default: the processor's (Qwen2.5-VL: "
                                          "12845056, ~16k tokens). Families that size images themselves refuse both.")
    assistant_only_loss: bool = option(True, "messages/alpaca: train on assistant tokens only.")
    train_turns: Literal["all", "last"] = option(
        "all", "Conversations: train every assistant turn, each as the chat template writes it when it is the last "
        "message (a template that rewrites earlier turns, e.g. drops their reasoning, makes one example per such "
        "turn), or only the 'last' one."
    )
    completion_only_loss: bool = option(True, "prompt_completion: train on completion tokens only.")
    skip_untrainable: bool = option(
        False, "Drop examples left with no trainable token instead of stopping with an error.")
    num_proc: int | None = option(None, "Processes that prepare (read and tokenise) the data, on the first process of "
                                  "each machine; default: the cores available, at most one per 5000 rows.")
    streaming: bool = option(False, "Train from a stream of the sources, each row read, tokenised (and packed) as "
                             "training goes, for corpora larger than memory or disk: needs training.max_steps; each "
                             "process reads its own share of the rows; a checkpoint records the stream's position.")
    on_stream_change: Literal["refuse", "restart", "continue"] = option(
        "refuse", "streaming: a resume whose sources changed since the checkpoint (rows added, removed or edited: "
        "their size, time or bytes differ) is refused; 'restart' streams them from their beginning (rows already "
        "trained on may come again), 'continue' resumes at the saved position anyway (when the rows are the same: "
        "a copy, a touch).")
    shuffle_buffer: int | None = option(None, "streaming: rows shuffled together (each window of this many rows is "
                                        "yielded in a random order; the order of files and blocks changes every pass); "
                                        "default 10000.")


@dataclass
class CompressionSection:
    method: CompressionMethod = option(
        "none", "Gradient compression on the data-parallel reduction. ddp: all methods; fsdp and zero1-3: fp16/bf16."
    )
    start_step: int | None = option(
        None, "Optimizer steps with uncompressed gradients first; default 2 for powersgd (its error feedback needs "
        "DDP's rebuilt buckets), else 0."
    )
    error_feedback: bool | None = option(
        None, "powersgd/int8/topk: add what the last step did not send to this step's gradient; default true."
    )
    powersgd_rank: int | None = option(None, "powersgd: rank of the low-rank approximation; default 4.")
    int8_granularity: Literal["chunk", "tensor"] | None = option(
        None, "int8: one scale per chunk of int8_chunk_size elements, or one per bucket ('tensor'); default chunk."
    )
    int8_chunk_size: int | None = option(None, "int8: elements per scale with granularity chunk; default 2048.")
    topk_ratio: float | None = option(None, "topk: share of gradient elements sent each step; default 0.01.")
    profile: bool = option(
        False, "ddp: time the gradient all-reduce also without compression (method none runs DDP's mean all-reduce "
        "in hftrain's timed hook) and log comm/* per step: bytes, time_share, seconds, hidden_share (share hidden "
        "behind the backward). With a method they are always logged."
    )

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

    def reduce_dtype(self) -> str | None:
        """'fp16' / 'bf16' when the method is a reduction dtype (FSDP2's reduce dtype, ZeRO's
        communication_data_type), else None."""
        return self.method if self.method in REDUCE_DTYPES else None


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
    push: bool = option(
        False, "After training, validate output_dir and upload it to the Hub (main process; `hftrain push` "
        "does the same for a finished run). The token comes from HF_TOKEN or `hf auth login`.")
    repo_id: str | None = option(None, "Target repository, e.g. your-name/model-name (created if missing).")
    private: bool = option(False, "Create the repository private (an existing repository keeps its visibility).")
    revision: str | None = option(None, "Branch to push to, created if missing; default: main.")
    commit_message: str | None = option(None, "Commit message; default: 'hftrain: upload <output_dir>'.")
    merge_lora: bool = option(False, "LoRA runs: push base + adapter merged into a full model (needs model.lora.merge) "
                              "instead of the adapter alone.")
    license: str | None = option(None, "License id for the model card, e.g. apache-2.0 (the base model's terms apply).")


@dataclass
class UpcycleSection:
    num_experts: int = option(8, "Experts per upcycled layer (copies of the dense MLP).")
    top_k: int = option(2, "Experts each token is routed to.")
    layers: list[int] | None = option(None, "Decoder layers to upcycle (0-based); default all. Mixtral needs all.")
    router_init_std: float | None = option(
        None, "Std of the routers' random init; default the model's initializer_range.")


@dataclass
class MoeSection:
    upcycle: UpcycleSection | None = option(
        None, "Turn the dense model into its native MoE counterpart (Llama/Mistral -> Mixtral, Qwen2 -> Qwen2-MoE) "
        "before training; outputs are unchanged at step 0."
    )
    aux_loss_coef: float = option(
        0.0, "Weight of the router load-balancing loss (0 = off); exact over ranks and accumulation."
    )
    router_z_loss_coef: float = option(0.0, "Weight of the router z-loss (0 = off).")
    router_health: bool = option(True, "Log per-layer expert load and router entropy; plot expert_load.png.")
    expert_parallel_size: int = option(
        1, "Place the experts across this many ranks (all_to_all dispatch); must equal the number of processes; "
        "strategy ddp or fsdp (the dense part sharded), Mixtral-style blocks."
    )
    capacity_factor: float | None = option(
        None, "Each expert takes at most ceil(factor * tokens * top_k / experts) of a rank's assignments; the rest "
        "are dropped (logged as moe/dropped_tokens). Unset: no dropping."
    )
    bias_update_rate: float | None = option(
        None, "Aux-loss-free balancing (DeepSeek-V3's): after each step every expert's router bias moves by this "
        "much towards balance, from the global batch's loads. Unset: 0.001 (the paper's) for routers with a bias "
        "(DeepSeek-V3, GLM-4.5), off for the others; 0: off."
    )


Problems = list[tuple[str, str]]  # (key as the user spells it, message with the fix)


class MethodSection:
    """A method's recipe section. The methods declare theirs in hftrain/methods/ as fields of their Recipe subclass
    (methods.Recipe); config builds them from YAML as it builds its own sections, and asks each for its rules instead
    of naming a method: over the whole recipe, under a strategy, and at launch (the processes, this machine)."""

    HELP: str = ""  # what the section is for, in `hftrain check` and the docs

    def problems(self, recipe: Recipe) -> Problems:
        return []

    def strategy_problems(self, recipe: Recipe, strategy: str) -> Problems:
        return []

    def launch_problems(self, recipe: Recipe, world: int, environment: bool) -> Problems:
        """`world`: the processes launched; `environment`: whether this machine is the one that runs."""
        return []


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
    origins: dict[str, str] = field(default_factory=dict, metadata={"help": "key -> 'command line' for overrides.",
                                                                    "internal": True})
    invalid: frozenset[str] = field(default=frozenset(), metadata={"help": "Keys found with a problem when read "
                                                                   "(checks that need them are skipped).",
                                                                   "internal": True})

    def where(self, key: str) -> str:
        """Where a key's value came from: the recipe file, or the command line for an override."""
        return origin_of(key, self.origins, self.source)

    @property
    def output_dir(self) -> str:
        return self.training["output_dir"]

    def method_sections(self) -> dict[str, MethodSection]:
        """The methods' sections this recipe holds (the fields methods.Recipe adds), by their recipe key."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), MethodSection)}

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        d.pop("origins")
        d.pop("invalid")
        return d

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    @property
    def resume_from_checkpoint(self) -> str | bool | None:
        return self.training.get("resume_from_checkpoint")

    @property
    def typed_training(self) -> TrainingValues:
        """The `training:` values hftrain reads, typed (config.training.TrainingValues)."""
        return typed_values(self.training)

    def training_value(self, name: str):
        """A `training:` value as the run will see it: the recipe's, else TrainingArguments' own default."""
        return training_value(self.training, name)


