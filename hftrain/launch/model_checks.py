"""What this machine says of the recipe's model and settings before anything is loaded: the model's paths, the
Trainer's and LoRA's own rules, the kernels and bitsandbytes; the values generation and datasets' map refuse.
Problems come back as (key, message) pairs; launch.preflight.environment_problems gathers them."""

from __future__ import annotations

from ..config import Recipe, RecipeError, arguments_kwargs, arguments_problem
from ..distributed import accelerator_available
from ..kernels import liger_problem
from ..methods import method_of
from ..modeling import local_config, path_problems
from ..quantization import bitsandbytes_problem
from ..methods.modality import modality_problems
from ..vision.families import family_problem, model_type_of
from ..vision.freezing import freeze_problems
from ..vision.lora_parts import lora_part_problems
from ..vision.part_rates import part_rate_problems
from . import libraries, model_libraries


def model_problems(recipe: Recipe, skip: set[str], model_ok: bool) -> list[tuple[str, str]]:
    """The model's paths, the Trainer's and LoRA's own rules, the kernels and bitsandbytes."""
    out: list[tuple[str, str]] = []
    m = recipe.model
    template = recipe.data.chat_template if recipe.data is not None else None
    if model_ok:
        out += path_problems(m, template if isinstance(template, str) else None)
        family = family_problem(model_type_of(m.name_or_path))  # an image-text-to-text family not checked
        if family:
            out.append(("model.name_or_path", family))
        out += freeze_problems(m)  # model.freeze: parts the family has
        out += lora_part_problems(m)  # model.lora.vision_parts: parts beside the language model adapted
        out += part_rate_problems(m)  # model.part_learning_rates: the parts' own rates
        out += policy_modality_problems(recipe)  # a modality the method does not train; its keys it cannot honour
        out += other_model_problems(recipe)
    if not any(k.startswith("training.") or k.startswith("model.") or k.startswith("data.") for k in skip) and (
            recipe.data is not None and m is not None):
        msg = arguments_problem(arguments_kwargs(recipe, accelerator_available()))
        if msg:
            out.append(("training", f"TrainingArguments refuses these values: {msg}"))
        else:  # what the Trainer, torch's DataLoader and the optimizer/scheduler factories would refuse in train()
            out += libraries.trainer_problems(recipe, accelerator_available())
    if model_ok and not any(k.startswith("model.lora") for k in skip):
        out += model_libraries.lora_problems(recipe)
    if model_ok and m.experts_implementation is not None and "model.experts_implementation" not in skip:
        out += model_libraries.experts_problems(recipe)
    if model_ok and recipe.typed_training.loss_impl == "fused" and "training.loss_impl" not in skip:
        out += model_libraries.fused_loss_problems(recipe)
    if model_ok and m.kernels == "liger" and "model.kernels" not in skip:
        config = local_config(m)
        problem = liger_problem(getattr(config, "model_type", None)) if config is not None else None
        if problem:
            out.append(("model.kernels", problem))
    if m is not None and m.quantization is not None and "model.quantization" not in skip:
        missing = bitsandbytes_problem()
        if missing:
            out.append(("model.quantization", missing))
    return out


def policy_modality_problems(recipe: Recipe) -> list[tuple[str, str]]:
    """What the policy reads (text, images: methods/modality.py) against what the recipe's method trains, and the keys
    that modality cannot honour (image rows: the strategies proven, the data keys); a method whose section is not
    readable yet names none."""
    try:
        method = method_of(recipe)
    except RecipeError:  # two method sections: config's rules say so
        return []
    return modality_problems(method, recipe)


def other_model_problems(recipe: Recipe) -> list[tuple[str, str]]:
    """The paths of the models the recipe's method holds beside the policy (a teacher, a reward model), under their
    own keys (methods.Method.others); a method whose section is not readable yet names none."""
    try:
        others = method_of(recipe).others(recipe)
    except RecipeError:  # two method sections: config's rules say so
        return []
    # a frozen copy of the policy (a reference) is the policy's own section: its paths are checked as the policy's
    return [problem for spec in others if spec.section is not recipe.model
            for problem in path_problems(spec.section, key=spec.key)]


def setting_problems(recipe: Recipe, skip: set[str]) -> list[tuple[str, str]]:
    """Values that generation and datasets' map refuse."""
    out: list[tuple[str, str]] = []
    if recipe.eval is not None and "eval.max_new_tokens" not in skip:
        msg = libraries.generation_problem(recipe.eval.max_new_tokens)
        if msg:
            out.append(("eval.max_new_tokens", msg))
    if recipe.data is not None and "data.num_proc" not in skip:
        msg = libraries.num_proc_problem(recipe.data.num_proc)
        if msg:
            out.append(("data.num_proc", msg))
    return out
