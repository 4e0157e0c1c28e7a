"""What the model's own libraries (transformers, peft, liger-kernel) would refuse of the recipe's model sections, asked
of the model built from its config on the meta device (no weights) before anything runs, as launch.libraries asks the
training libraries: the `moe:` section against the model and the launch, model.experts_implementation, the fused
loss, and what peft refuses of model.lora. The run refuses the same of the loaded model."""

from __future__ import annotations

import dataclasses
import warnings

import torch

from ..config import LoraSection, MoeSection, Recipe
from ..heads import Head
from ..losses import fused_ce
from ..methods import policy_head
from ..modeling import local_config, lora_config
from ..modeling.lora import unmatched_target_parameters
from ..moe.balance import bias_rate_problem
from ..moe.blocks import moe_blocks
from ..moe.capabilities import section_problems
from .libraries import blame, one_line, quiet
from .resume import meta_model


# -- MoE ------------------------------------------------------------------------------------------------------------
def moe_problems(recipe: Recipe, world: int) -> list[tuple[str, str]]:
    """The `moe:` section against the launch and the model, before anything loads (the run's moe.attach refuses the
    same of the loaded model): the experts are split over every process, so moe.expert_parallel_size equals their
    number; every key must be one the model can honour (moe.capabilities, on the model built from its config on the
    meta device). An upcycled model is built from another config: only its bias rate is judged (no upcycled family
    has a biased router). Keys already wrong are not judged again."""
    moe, n = recipe.moe, getattr(recipe.moe, "expert_parallel_size", 1)
    if not isinstance(moe, MoeSection):
        return []
    out = []
    if isinstance(n, int) and n > 1 and n != world and "moe.expert_parallel_size" not in recipe.invalid:
        out.append(("moe.expert_parallel_size", f"must equal the number of processes ({world}), got {n}: the "
                    "experts are split over every process (no expert-parallel groups inside data parallelism); "
                    f"launch {n} processes, or set it to {world}"))
    config = local_config(recipe.model) if "model.name_or_path" not in recipe.invalid else None
    if config is None or any(k.startswith("moe.") for k in recipe.invalid):
        return out
    model = _policy_on_meta(recipe, config)
    if moe.upcycle is not None and moe_blocks(model):  # refused only after the model loaded, by the upcycling
        return out + [("moe.upcycle", f"{recipe.model.name_or_path} is already a mixture-of-experts model "
                       f"({config.model_type}, {len(moe_blocks(model))} MoE blocks): remove moe.upcycle to train it "
                       "as it is")]
    if moe.upcycle is not None:
        problem = bias_rate_problem(model, moe.bias_update_rate)
        return out + ([("moe.bias_update_rate", problem.split(": ", 1)[1])] if problem else [])
    return out + section_problems(model, moe)


def experts_problems(recipe: Recipe) -> list[tuple[str, str]]:
    """model.experts_implementation asked of a model whose class cannot set it (a dense model): transformers refuses
    it when the weights load; asked here of the model built from its config on the meta device."""
    config = local_config(recipe.model)
    if config is None or _policy_on_meta(recipe, config)._can_set_experts_implementation():
        return []
    return [("model.experts_implementation", f"{recipe.model.name_or_path} ({config.model_type}) has no experts "
             "whose implementation transformers can set (not an MoE model): remove it")]


def fused_loss_problems(recipe: Recipe) -> list[tuple[str, str]]:
    """training.loss_impl: fused where liger's kernel cannot run: no liger-kernel, no CUDA GPU for the run (or
    training.use_cpu), a head whose logits it does not compute (asked of the model built on the meta device); the
    run's trainer refuses the same of the loaded model (losses.chunked)."""
    cuda = torch.cuda.is_available() and not recipe.typed_training.use_cpu
    why = fused_ce.machine_problem("cuda" if cuda else "cpu")
    if why is not None:
        return [("training.loss_impl", fused_ce.refusal(why))]
    config = local_config(recipe.model)
    problem = None if config is None else fused_ce.where_problem(_policy_on_meta(recipe, config), "cuda")
    return [("training.loss_impl", problem)] if problem else []


def _policy_on_meta(recipe: Recipe, config):
    """The model the recipe's method trains (its head: methods.policy_head), built from `config` on the meta device."""
    return meta_model(config, recipe.model.trust_remote_code, policy_head(recipe))


# -- peft -----------------------------------------------------------------------------------------------------------
def _try_lora(model_section, config, head: Head) -> str | None:
    from peft import get_peft_model  # optional dependency: LoRA runs only

    try:
        with warnings.catch_warnings(), quiet():
            warnings.simplefilter("ignore")
            get_peft_model(meta_model(config, model_section.trust_remote_code, head), lora_config(model_section, head))
    except Exception as e:  # whatever peft (or torch, building the adapter's layers) raises for these values
        return one_line(e)
    return None


def _unmatched(missing: list[str], model, name: str) -> str:
    """The refusal of target_parameters entries that match nothing, with the model's own parameter names that are
    no Linear module's weight (what target_parameters is for: fused experts)."""
    linear = {f"{n}.weight" for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    own = sorted({n.split(".", 3)[-1] if n.count(".") > 3 else n for n, _ in model.named_parameters()
                  if n not in linear and "experts" in n})
    return (f"{', '.join(repr(t) for t in missing)} name{'s' if len(missing) == 1 else ''} no parameter of {name} "
            f"(peft would adapt the others and ignore {'it' if len(missing) == 1 else 'them'}); its experts' "
            f"parameters are {', '.join(own[:6]) or 'none'}: name those (fused ones adapt every expert's matrices)")


def lora_problems(recipe: Recipe) -> list[tuple[str, str]]:
    """(key, problem) for what peft refuses of model.lora on this model (a target module it does not have, a dropout
    torch refuses, ...): peft's get_peft_model on the model built from its config on the meta device (no weights)."""
    m = recipe.model
    if not isinstance(m.lora, LoraSection):
        return []
    config = local_config(m)
    if config is None:
        return []
    head = policy_head(recipe)
    model = meta_model(config, m.trust_remote_code, head)
    missing = unmatched_target_parameters(model, m.lora.target_parameters)
    if missing:
        return [("model.lora.target_parameters", _unmatched(missing, model, m.name_or_path))]
    why = _try_lora(m, config, head)
    if why is None:
        return []
    defaults = LoraSection()
    retries = {f"model.lora.{f.name}": (lambda f=f: _try_lora(dataclasses.replace(
        m, lora=dataclasses.replace(m.lora, **{f.name: getattr(defaults, f.name)})), config, head))
        for f in dataclasses.fields(LoraSection) if getattr(m.lora, f.name) != getattr(defaults, f.name)}
    keys = blame(retries)
    named = ", ".join(f"{k} ({getattr(m.lora, k.rsplit('.', 1)[1])!r})" for k in keys)
    return [(keys[0] if keys else "model.lora",
             f"{named or 'model.lora'}: peft refuses {'it' if len(keys) == 1 else 'these values'} on "
             f"{m.name_or_path} ({why}); change {'it' if len(keys) == 1 else 'them'} to a value it accepts")]
