"""The words hftrain spells once: strategy and compression names, label and probe ids, the files a run writes."""

from __future__ import annotations

from typing import Literal, get_args

StrategyName = Literal["ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload", "zero_infinity"]
STRATEGIES: tuple[str, ...] = get_args(StrategyName)
ZERO_STAGE = {"zero1": 1, "zero2": 2, "zero3": 3, "zero3_offload": 3, "zero_infinity": 3}
ZERO3 = frozenset(name for name, stage in ZERO_STAGE.items() if stage == 3)
SHARDED = ZERO3 | {"fsdp"}  # no rank holds all parameters
# Where strategy.sequence_parallel runs (DeepSpeed Ulysses) and is tested exact; the attention kernels it can wrap
# (accelerate's DeepSpeedSequenceParallelConfig: eager and flex_attention are refused upstream).
SEQUENCE_PARALLEL_STRATEGIES = ("zero2", "zero3")
# Where a bitsandbytes-quantised base (QLoRA) is tested exact (tests/test_quantization*.py); FSDP and ZeRO-3 with
# their storage dtype rule (config.strategy_rules.quantized_strategy_problems).
QUANTIZED_STRATEGIES = ("ddp", "fsdp", "zero3")
SEQUENCE_PARALLEL_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")
OFFLOADED = frozenset({"zero3_offload", "zero_infinity"})  # optimizer states off the GPU, updated by DeepSpeed's Adam

CompressionMethod = Literal["none", "fp16", "bf16", "powersgd", "int8", "topk"]
DDP_ONLY_COMPRESSION = ("powersgd", "int8", "topk")  # communication hooks: DDP only
REDUCE_DTYPES = ("fp16", "bf16")  # the methods FSDP2 and ZeRO run as their reduction dtype

LossAveraging = Literal["token", "sequence"]
LossImpl = Literal["auto", "chunked", "fused", "logits"]  # training.loss_impl: how the per-token CE is computed

DataLayout = Literal["messages", "sharegpt", "prompt_completion", "alpaca", "text"]  # detected in this order
ROLES = ("system", "user", "assistant", "tool")  # the roles of a canonical conversation
# what a recipe's `roles` mapping may map to: a canonical role, or ShareGPT's assistant tool call
ROLE_TARGETS = ROLES + ("function_call",)

IGNORE_INDEX = -100  # a label the loss skips (transformers' and torch's convention)
PROBE_IDS = [[1, 5, 9, 13, 17, 21, 25, 29]]  # a fixed input whose logits run_info.json records

RECIPE_FILE = "recipe.yaml"  # the resolved recipe beside the model
RUN_INFO_FILE = "run_info.json"  # what actually ran
HARNESS_RESULTS_FILE = "eval_harness.json"  # `hftrain eval`'s table, base against trained (on the model card)
# The SLURM job's folder in output_dir (`hftrain config --slurm`): its logs (slurm-<job id>.out), its working files.
SLURM_DIR = "slurm"
STOP_MARKER_ENV = "HFTRAIN_STOP_MARKER"  # a file the main process writes when it stopped on a request (SIGUSR1)
# Recipe kind -> the module hftrain/recipes/ runs under the launcher (`hftrain launch` picks by the recipe's sections).
