"""What this machine and the model say of the strategy (the recipe's own rules for it are config.strategy_rules): the
engine the environment forces, NVMe and async I/O for ZeRO-Infinity, the model's heads against sequence parallelism,
and ZeRO-Infinity's buffers sized to the model."""

from __future__ import annotations

from dataclasses import replace

from ..config import Recipe, StrategySection, resolved_strategy
from ..config.fields import is_of_type
from ..distributed import accelerator_available
from ..guards import environment_engine_problem
from ..methods import policy_head
from ..mesh import tensor_parallel_problem
from ..sequence_parallel import heads_problem
from .machine import async_io_problem, nvme_problems
from .plan import model_facts, swap_buffer_elems

# Bytes per parameter that ZeRO-Infinity swaps to NVMe, summed over the ranks of a node: the parameters
# (conservatively fp32) plus the optimizer's fp32 gradients, master weights and two moments (launch.plan).
NVME_BYTES_PER_PARAM = 4 + 16
# Context parallelism renders (hftrain config) but no run takes it yet: the Trainer splits each row's tokens over the
# cp ranks inside its step, and hftrain's exact loss (the step's global target count, losses/) has no share of a
# split row, as it has for Ulysses (sequence_parallel/): the loss would be scaled by the cp degree, unmeasured.
CONTEXT_PARALLEL_REFUSAL = ("strategy.cp_size: context parallelism is rendered into the accelerate config but not run "
                            "by hftrain yet (its exact token loss has no count for rows split over the cp ranks; "
                            "bench/gpu.py measures accelerate's own on a GPU); use strategy.name: zero3 with "
                            "strategy.sequence_parallel (Ulysses) for long sequences, or remove cp_size")


def facts_or_none(recipe: Recipe):
    """launch.plan.model_facts of the model the recipe's method trains (its head: methods.policy_head), or None when
    the config cannot be read here (e.g. an unreachable Hub id: loading the model will then say so)."""
    m = recipe.model
    try:
        return model_facts(m.name_or_path, trust_remote_code=m.trust_remote_code, head=policy_head(recipe))
    except Exception:
        return None


def machine_strategy_problems(strategy: StrategySection, num_parameters: int | None = None) -> list[str]:
    """What this machine says of the strategy (the recipe's rules are config.rules.strategy_problems): the engine the
    environment forces, NVMe and async I/O for ZeRO-Infinity."""
    problems = []
    engine = environment_engine_problem(strategy.name, accelerator_available())
    if engine:
        problems.append(engine)
    if strategy.name == "zero_infinity":
        s = resolved_strategy(strategy)
        need = num_parameters * NVME_BYTES_PER_PARAM if num_parameters else None
        problems += nvme_problems(s.nvme_path, need)
        p = async_io_problem()
        if p:
            problems.append(p)
    if strategy.name == "fsdp" and strategy.mesh().context > 1:
        problems.append(CONTEXT_PARALLEL_REFUSAL if accelerator_available() else
                        CONTEXT_PARALLEL_REFUSAL + "; on this machine without a GPU torch has no CPU rule for it "
                        "either (no DTensor sharding rule for _scaled_dot_product_flash_attention_for_cpu)")
    if strategy.name == "fsdp" and strategy.fsdp_offload_params and not accelerator_available():
        problems.append("strategy.fsdp_offload_params: there is no accelerator to offload from on this machine; "
                        "remove it (parameters already live in CPU memory)")
    return problems


def machine_problems(recipe: Recipe, strategy: StrategySection, world: int, skip: set[str], model_ok: bool
                      ) -> tuple[StrategySection, list[tuple[str, str]]]:
    """The model's heads against sequence parallelism, NVMe's buffers sized to the model, and what this machine can
    run of the strategy; the strategy comes back with the sizes filled in."""
    out: list[tuple[str, str]] = []
    m = recipe.model
    sp = strategy.sequence_parallel if is_of_type(strategy.sequence_parallel, int) else 1
    heads = config_problem(m.name_or_path, m.trust_remote_code, heads_problem, sp) if model_ok and sp > 1 else None
    if heads:
        out.append(("strategy.sequence_parallel", heads))
    tp = strategy.resolved_tensor_parallel() if is_of_type(strategy.tp_size, int) else 1
    split = (config_problem(m.name_or_path, m.trust_remote_code, tensor_parallel_problem, tp)
             if model_ok and tp > 1 else None)
    if split:
        out.append(("strategy.tp_size", split))
    facts = None
    if strategy.name == "zero_infinity" and model_ok:
        facts = facts_or_none(recipe)
    if facts is not None:
        # DeepSpeed's usual 1e8 and 1e9 elements pin GBs of RAM per rank whatever the model; sized to the largest
        # parameter partition NVMe holds the rest. DeepSpeed sizes its optimizer swap buffers to the largest
        # sub-group.
        part = swap_buffer_elems(facts.largest_tensor, world)
        if strategy.buffer_size is None:
            strategy = replace(strategy, buffer_size=part)
        if strategy.sub_group_size is None:
            strategy = replace(strategy, sub_group_size=part)
    if not any(k.startswith("strategy.") for k in skip):
        machine = machine_strategy_problems(strategy, facts.params if facts else None)
        out += [(_strategy_key(msg), msg) for msg in machine]
    return strategy, out


def config_problem(name_or_path: str, trust_remote_code: bool, rule, n: int) -> str | None:
    """`rule(config, n)` of the model's config (sequence_parallel.heads_problem, mesh.tensor_parallel_problem), None
    when the config cannot be read here (loading says so)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except Exception:
        return None
    return rule(config, n)


def _strategy_key(msg: str) -> str:
    key = msg.split(":", 1)[0]
    return key if key.startswith("strategy.") else "strategy.name"
