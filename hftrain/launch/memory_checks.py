"""Whether the models a method holds beside its policy (a teacher: methods.Method.others) fit this machine's device
in the memory plan, before anything loads (hftrain check and the run alike, through preflight.environment_problems).

The plan (launch.plan.recipe_plan, what `hftrain plan` prints) is taken for the strategy that will run, with the
processes of one machine as its devices per node; its per-device total with the frozen models (their weights,
sharded under fsdp and zero3 as the policy's, whole under ddp) is compared with what one device has:
- a GPU: the smallest visible GPU's total memory;
- no GPU: the machine's RAM divided among its processes (each holds in RAM what the plan puts on a GPU: the rule
  docs/benchmarks.md measures, bench/memory.py's tensors per rank against the plan on CPU ranks).
Refused only where the policy alone fits and the frozen models tip it over: that is a frozen model too large for
the plan, named by its key with the fixes (a sharded strategy, 16-bit weights, quantisation). A policy that does not
fit alone is not judged here: the plan's activations are an estimate, and nothing refuses an SFT run on them."""

from __future__ import annotations

import os

import torch

from ..config import StrategySection
from ..config.fields import is_of_type
from ..errors import RecipeError
from ..methods import Recipe, method_of
from .plan import GiB, Row, recipe_plan

SHARDED = ("fsdp", "zero3")


def device_memory(processes_here: int) -> tuple[float, str]:
    """(bytes one process's device has, what they are, in words)."""
    if torch.cuda.is_available():
        total = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        return total, f"this machine's GPU has {total / GiB:.1f} GiB"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / processes_here, (f"no GPU here: {ram / GiB:.1f} GiB of RAM shared by {processes_here} process(es), "
                                  "each holding what the plan puts on a GPU")


def _row(rows: list[Row], strategy: str) -> Row:
    return next(r for r in rows if r.strategy == strategy)


def _fixes(spec, strategy: str) -> str:
    """The changes that shrink the frozen model's share, those that apply."""
    out = [] if strategy in SHARDED else ["shard it over the processes (strategy.name: fsdp or zero3)"]
    if spec.section.dtype not in ("bfloat16", "float16"):
        out.append(f"load it in 16 bits ({spec.key}.dtype: bfloat16)")
    if spec.section.quantization is None:
        out.append(f"quantise it ({spec.key}.quantization)")
    return ", ".join(out) if out else "use more processes, or a smaller model"


def frozen_fit_problems(recipe: Recipe, strategy: StrategySection, world: int, skip: set[str]
                        ) -> list[tuple[str, str]]:
    """A problem under the largest frozen model's key when, with the frozen models, the plan no longer fits the
    device (the module docstring)."""
    try:
        keys = [spec.key for spec in method_of(recipe).others(recipe)]
    except RecipeError:  # two method sections: config's rules say so
        return []
    if not keys or any(k.startswith(("model.", "data.", "training.", "strategy.", *keys)) for k in skip):
        return []
    nodes = strategy.num_machines if is_of_type(strategy.num_machines, int) and strategy.num_machines > 0 else 1
    here = max(world // nodes, 1)
    try:
        planned = recipe_plan(recipe, here, nodes)
    except Exception:  # noqa: BLE001 - a config that cannot be read here: the path checks say why
        return []
    budget, device = device_memory(here)
    taught, alone = _row(planned.rows, strategy.name), _row(planned.policy_rows, strategy.name)
    if taught.gpu_total <= budget or alone.gpu_total > budget:
        return []
    spec, facts = max(planned.frozen, key=lambda pair: pair[1].params)
    return [(spec.key, f"{spec.section.name_or_path} ({facts.params / 1e9:.2f}B parameters, frozen) does not fit "
             f"the memory plan: under {strategy.name} on {world} process(es) the frozen weights add "
             f"{(taught.gpu_params - alone.gpu_params) / GiB:.2f} GiB per device to the policy's "
             f"{alone.gpu_total / GiB:.2f} GiB, {taught.gpu_total / GiB:.2f} GiB in all, over {budget / GiB:.2f} GiB "
             f"({device}; `hftrain plan` shows every strategy): {_fixes(spec, strategy.name)}")]
