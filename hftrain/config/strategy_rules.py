"""The strategy's rules: the strategy: section's own values, and what can run under a named strategy (its options,
compression, offloaded optimizers, sequence parallelism, a quantised base, experts). Each problem is (key as the
user spells it, message with the fix); nothing here reads the environment (launch.preflight does)."""

from __future__ import annotations

from dataclasses import fields

from ..constants import (DDP_ONLY_COMPRESSION, OFFLOADED, QUANTIZED_STRATEGIES, REDUCE_DTYPES,
                         SEQUENCE_PARALLEL_ATTENTION, SEQUENCE_PARALLEL_STRATEGIES, SHARDED, STRATEGIES, ZERO_STAGE)
from .fields import is_number as _num
from .mesh_rules import mesh_problems
from .sections import CompressionSection, MoeSection, Problems, Recipe
from .strategy import STRATEGY_OPTIONS, StrategySection

MIN_RANK_TIMEOUT = 10  # seconds; the heartbeat beats every min(5, timeout / 5) s, a few beats must fit


def section_problems(s: StrategySection) -> Problems:
    """The strategy: section's own values, whatever the strategy."""
    out: Problems = []
    t = s.rank_timeout
    if _num(t) and t != 0 and not MIN_RANK_TIMEOUT <= t:
        out.append(("strategy.rank_timeout", f"must be 0 (off) or at least {MIN_RANK_TIMEOUT} seconds, got {t}"))
    _machine_problems(s, out)
    if _num(s.sequence_parallel) and s.sequence_parallel < 1:
        out.append(("strategy.sequence_parallel", f"must be at least 1 (1: off), got {s.sequence_parallel}"))
    return out


def _machine_problems(s: StrategySection, out: Problems) -> None:
    """Several machines: each runs num_processes / num_machines processes, and knows its own rank among them."""
    machines = s.num_machines if _num(s.num_machines) else 1
    if _num(s.num_processes) and s.num_processes < 1:
        out.append(("strategy.num_processes", f"must be at least 1, got {s.num_processes}"))
    if _num(s.num_machines) and s.num_machines < 1:
        out.append(("strategy.num_machines", f"must be at least 1, got {s.num_machines}"))
        return
    if _num(s.machine_rank) and not 0 <= s.machine_rank < machines:
        out.append(("strategy.machine_rank", f"must be 0 .. {machines - 1} (strategy.num_machines is {machines}), "
                    f"got {s.machine_rank}; start machine k with strategy.machine_rank=k"))
    if _num(s.num_processes) and machines > 1 and (s.num_processes < machines or s.num_processes % machines):
        out.append(("strategy.num_processes", f"is the processes of all machines together, and must be a multiple "
                    f"of strategy.num_machines ({machines}), got {s.num_processes}; e.g. 2 machines x 8 GPUs is "
                    f"num_processes: 16"))


def strategy_problems(recipe: Recipe, name: str) -> Problems:
    """What cannot run under strategy `name`: options it does not read, compression it cannot apply, an optimizer
    it cannot offload, experts it would shard. Each names what works instead."""
    out: Problems = []
    s = recipe.strategy
    if isinstance(s, StrategySection):
        for f in fields(s):
            if f.name == "sequence_parallel" and s.sequence_parallel in (None, 1):
                continue  # 1 is "off" under every strategy
            if f.name == "sequence_parallel" and name not in SEQUENCE_PARALLEL_STRATEGIES:
                out.append(("strategy.sequence_parallel", f"runs on DeepSpeed's Ulysses under "
                            f"{' or '.join(SEQUENCE_PARALLEL_STRATEGIES)}, not '{name}'" + (
                                " (FSDP2 has no sequence parallelism here; zero3 shards parameters, gradients and "
                                "optimizer states as FSDP2 does)" if name == "fsdp" else "") +
                            ": set strategy.name: zero3 (or zero2), or remove strategy.sequence_parallel"))
                continue
            if f.name not in STRATEGY_OPTIONS[name] and getattr(s, f.name) is not None:
                users = [n for n in STRATEGIES if f.name in STRATEGY_OPTIONS[n]]
                out.append((f"strategy.{f.name}",
                            f"does not apply to strategy '{name}' (it applies to {', '.join(users)})"))
    c = recipe.compression
    if isinstance(c, CompressionSection) and c.method in DDP_ONLY_COMPRESSION and name != "ddp":
        out.append(("compression.method", f"'{c.method}' runs only as a DDP communication hook, not under "
                    f"'{name}'; use strategy ddp, or compression.method fp16/bf16 (reduce dtype) with '{name}'"))
    if isinstance(c, CompressionSection) and c.profile is True and name != "ddp":
        out.append(("compression.profile", f"times DDP's gradient all-reduce in a communication hook; '{name}' "
                    "reduces inside its own engine, with no hook to time: use strategy ddp, or remove it"))
    if (isinstance(c, CompressionSection) and c.method == "powersgd"
            and recipe.typed_training.ddp_find_unused_parameters is True):
        out.append(("training.ddp_find_unused_parameters", "must be false with compression.method powersgd: "
                    "PowerSGD's second all-reduce, issued from a future callback, races DDP's unused-parameter "
                    "all-reduce and hangs or fails on gloo. hftrain sets it false when you leave it unset"))
    bad = recipe.typed_training.max_bad_steps
    if name in ZERO_STAGE and _num(bad) and bad > 0:
        out.append(("training.max_bad_steps", f"cannot skip steps under '{name}': DeepSpeed's engine applies the "
                    "update inside backward, before the step can be judged; set it to 0 (a non-finite step then "
                    "stops the run), or use strategy ddp or fsdp"))
    optim = str(recipe.typed_training.optim)
    if name in OFFLOADED and not optim.startswith("adamw"):
        out.append(("training.optim", f"'{optim}' cannot be used with '{name}': the optimizer states live off the "
                    "GPU and DeepSpeed's own AdamW updates them; use an adamw_* optim or zero3"))
    for section in recipe.method_sections().values():  # where the method runs (hftrain/methods/)
        out += section.strategy_problems(recipe, name)
    if isinstance(s, StrategySection) and _num(s.sequence_parallel) and s.sequence_parallel > 1:
        out += sequence_parallel_problems(recipe, s.sequence_parallel)
    if recipe.model is not None and recipe.model.quantization is not None:
        out += quantized_strategy_problems(recipe, name)
    if isinstance(recipe.moe, MoeSection):
        out += moe_strategy_problems(recipe.moe, s, name)
    if name in ("ddp", "fsdp"):
        out += mesh_problems(recipe, name)
    return out


def moe_strategy_problems(m: MoeSection, s: StrategySection, name: str) -> Problems:
    """Where the expert-parallel layer runs (moe.expert_parallel_size, moe.capacity_factor): its own experts on each
    rank, under DDP or FSDP2 (the dense part sharded), with every parameter on the GPU."""
    out: Problems = []
    parallel = isinstance(m.expert_parallel_size, int) and m.expert_parallel_size > 1
    if parallel and name not in ("ddp", "fsdp"):
        out.append(("moe.expert_parallel_size", f"runs under strategy ddp or fsdp, not {name!r}: ZeRO would "
                    "shard or average the per-rank experts. Use strategy.name: ddp or fsdp (the dense part "
                    "sharded, each rank's experts its own), or keep every expert on every rank "
                    "(expert_parallel_size: 1) with ZeRO-3 (MoE blocks are made leaf modules)"))
    if parallel and name == "fsdp" and isinstance(s, StrategySection) and s.fsdp_offload_params is True:
        out.append(("strategy.fsdp_offload_params", "cannot be combined with moe.expert_parallel_size > 1: each "
                    "rank's experts stay on its GPU while the offloaded dense part is on the CPU, and the gradient "
                    "norm over both mixes CPU and GPU tensors; set it to false, or keep every expert on every rank "
                    "(expert_parallel_size: 1)"))
    if not parallel and _num(m.capacity_factor) and name in SHARDED:
        out.append(("moe.capacity_factor", f"needs the whole MoE block on each rank, which '{name}' shards; use "
                    "strategy.name: ddp, or split the experts over the ranks (moe.expert_parallel_size) under fsdp"))
    return out


def sequence_parallel_problems(recipe: Recipe, n: int) -> Problems:
    """What cannot run with every sequence split across `n` ranks (strategy.sequence_parallel), whatever the ZeRO
    stage; the model's heads and the world size are checked where they are known (launch.preflight)."""
    out: Problems = []
    s = recipe.strategy
    if _num(s.num_processes) and s.num_processes % n:
        out.append(("strategy.num_processes", f"must be a multiple of strategy.sequence_parallel ({n}): the "
                    f"processes form data-parallel groups of {n} ranks that share each sequence; got "
                    f"{s.num_processes}"))
    attn = recipe.model.attn_implementation if recipe.model is not None else None
    if isinstance(attn, str) and attn not in SEQUENCE_PARALLEL_ATTENTION and not (
            "/" in attn and "flash-attn" in attn):
        out.append(("model.attn_implementation", f"'{attn}' cannot run under strategy.sequence_parallel (Ulysses "
                    "drops the attention mask and needs a kernel that masks causally by itself): use "
                    f"{', '.join(SEQUENCE_PARALLEL_ATTENTION)} (default sdpa), or a hub flash-attn kernel"))
    c = recipe.compression
    if isinstance(c, CompressionSection) and c.method in REDUCE_DTYPES:
        out.append(("compression.method", f"'{c.method}' cannot be used with strategy.sequence_parallel: DeepSpeed "
                    "reduces gradients in fp32 under sequence parallelism (its seq_parallel_communication_data_type), "
                    "so the reduce dtype would be ignored; remove compression"))
    if recipe.moe is not None:
        out.append(("moe", "cannot be combined with strategy.sequence_parallel: the router losses are means over "
                    "a rank's tokens and would not be exact over a split sequence; remove one of them"))
    return out


def quantized_strategy_problems(recipe: Recipe, name: str) -> Problems:
    """Where a quantised base trains: DDP, FSDP (2) and ZeRO-3, the sharded two when they can shard the packed 4-bit
    weights. They shard a parameter as a tensor of its dtype and cast it to the dtype they compute in, which turns
    packed bytes into other numbers: the weights must be stored in that dtype (measured on an H200: float32 storage
    under FSDP's bf16 trained without an error on gradients 2000x off; bench/qlora_fsdp.py)."""
    q, out = recipe.model.quantization, []
    if name not in QUANTIZED_STRATEGIES:
        return [("model.quantization", f"a quantised base trains under {', '.join(QUANTIZED_STRATEGIES)} (where "
                 f"its exactness is tested), not '{name}' (not tried with bitsandbytes' packed weights). Use "
                 "strategy.name: fsdp or zero3 to shard a 4-bit base, or ddp")]
    if name not in SHARDED:
        return out
    if q.bits != 4:
        return out + [("model.quantization.bits", f"{name} shards a 4-bit base only (bitsandbytes' 8-bit weights "
                       "are integers with row statistics beside them): set model.quantization.bits: 4, or "
                       "strategy.name: ddp")]
    want = ("bfloat16" if recipe.typed_training.bf16 is True else
            "float16" if recipe.typed_training.fp16 is True else "float32")
    if q.storage_dtype != want:
        out.append(("model.quantization.storage_dtype", f"is {q.storage_dtype or 'uint8 (the default)'}: under "
                    f"{name} the packed 4-bit weights must be stored in the dtype it computes in, here {want} "
                    "(another float dtype is cast and corrupted, and uint8 is not tested sharded); set "
                    f"model.quantization.storage_dtype: {want}"))
    return out
