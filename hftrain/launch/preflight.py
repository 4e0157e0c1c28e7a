"""The one validation path: every problem a recipe has in this environment, found before anything is loaded.

`check_recipe` (called by `hftrain check`, `config`, `launch` and the run) raises the recipe's own problems, its
strategy's and this machine's all at once; `check_data` is the data phase `hftrain check` and the run share.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Callable

from .. import checkpoints, outdir
from ..config import Recipe, StrategySection, arguments_kwargs, arguments_problem, resolved_strategy
from ..config.strategy_rules import strategy_problems
from ..config.strategy import STRATEGY_DEFAULTS
from ..constants import STRATEGIES, ZERO_STAGE
from ..data.stream_position import stream_resume_problems
from ..distributed import accelerator_available, print0, restart_count
from ..errors import LaunchError, RecipeError
from ..guards import environment_engine_problem
from ..methods import method_of, parse_recipe
from ..kernels import liger_problem
from ..modeling import load_tokenizer, local_config, path_problems
from ..quantization import bitsandbytes_problem
from ..sequence_parallel import heads_problem
from . import libraries
from .machine import async_io_problem, extensions_dir, nvme_problems, stale_build_locks, unwritable
from .plan import model_facts, swap_buffer_elems
from .resume import compatibility_problems

# Bytes per parameter that ZeRO-Infinity swaps to NVMe, summed over the ranks of a node: the parameters
# (conservatively fp32) plus the optimizer's fp32 gradients, master weights and two moments (launch.plan).
NVME_BYTES_PER_PARAM = 4 + 16


def facts_or_none(name_or_path: str, trust_remote_code: bool = False):
    """launch.plan.model_facts, or None when the config cannot be read here (e.g. an unreachable Hub id: loading
    the model will then say so)."""
    try:
        return model_facts(name_or_path, trust_remote_code=trust_remote_code)
    except Exception:
        return None


def machine_strategy_problems(strategy: StrategySection, num_parameters: int | None = None) -> list[str]:
    """What this machine says of the strategy (the recipe's rules are config.rules.strategy_problems): the engine the
    environment forces, interrupted DeepSpeed op builds, NVMe and async I/O for ZeRO-Infinity."""
    problems = []
    engine = environment_engine_problem(strategy.name, accelerator_available())
    if engine:
        problems.append(engine)
    if strategy.name in ZERO_STAGE:
        problems += [f"DeepSpeed op build lock {lock} is {age / 60:.0f} min old: a build was interrupted and every "
                     f"run needing that op would wait for it forever; remove it (rm {lock})"
                     for lock, age in stale_build_locks(extensions_dir())]
    if strategy.name == "zero_infinity":
        s = resolved_strategy(strategy)
        need = num_parameters * NVME_BYTES_PER_PARAM if num_parameters else None
        problems += nvme_problems(s.nvme_path, need)
        p = async_io_problem()
        if p:
            problems.append(p)
    if strategy.name == "fsdp" and strategy.fsdp_offload_params and not accelerator_available():
        problems.append("strategy.fsdp_offload_params: there is no accelerator to offload from on this machine; "
                        "remove it (parameters already live in CPU memory)")
    return problems


def protected_folders(recipe: Recipe) -> dict[str, str]:
    """The folders a run reads from that its output_dir must not be, hold or lie in: description -> path."""
    m = recipe.model
    reads = {"model.name_or_path": getattr(m, "name_or_path", None),
             "model.tokenizer_name_or_path": getattr(m, "tokenizer_name_or_path", None)}
    return {f"{key}'s folder": p for key, p in reads.items() if isinstance(p, str) and os.path.isdir(p)}


def output_dir_problems(path: str, protected: dict[str, str] | None = None) -> list[str]:
    """output_dir is a folder of its own (guarded_folder_problem), and it, or the folder it will be created in, is
    writable. Nothing is created here: a refused run leaves nothing behind."""
    guarded = outdir.guarded_folder_problem(path, protected)
    if guarded:
        return [guarded]
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return [f"training.output_dir: {path} cannot be created: {parent} is not a folder; choose another path"]
    why = unwritable(parent)
    if why:
        return [f"training.output_dir: cannot write in {parent} ({why}); fix its permissions or choose another folder"]
    return []


def resume_problems(value, output_dir: str, layout: dict | None = None, weights_only: bool = False,
                    recipe: Recipe | None = None, warn=lambda _m: None) -> list[str]:
    """training.resume_from_checkpoint names (or, when true, finds) a complete checkpoint that this run's layout
    (checkpoints.layout) can resume exactly and, with `recipe`, of the model, vocabulary and LoRA adapter the recipe
    builds (launch.resume): checked before any model is loaded, not minutes later in train(). `warn` hears what is
    accepted with a caveat (a checkpoint without a manifest, and who wrote it)."""
    try:
        path = checkpoints.resolve_resume(value, output_dir, warn=warn, weights_only=weights_only)
        if layout is not None:
            checkpoints.check_layout(path, layout)
    except checkpoints.CheckpointError as e:
        return [str(e)]
    if path is None or recipe is None or recipe.model is None:
        return []
    streams = stream_resume_problems(path, recipe.data) if recipe.data is not None else []
    return compatibility_problems(path, recipe, load_tokenizer=lambda m: load_tokenizer(m)) + streams


def _message(recipe: Recipe, key: str, msg: str) -> str:
    """'origin: key: message' (a message that already begins with its key keeps its own wording)."""
    return f"{recipe.where(key)}: {msg if msg.startswith(key) else f'{key}: {msg}'}"


def _typed(value, tp) -> bool:
    return isinstance(value, tp) and not isinstance(value, bool)


def check_recipe(path: str | None, overrides: list[str] | None = None, *, raw: dict | None = None,
                 launcher: str | None = None, world_size: int | None = None, environment: bool = True,
                 script: list[str] | Callable[[Recipe], list[str]] | None = None
                 ) -> tuple[Recipe, StrategySection]:
    """The recipe and the strategy that will run, or a RecipeError with every problem found.

    `launcher` is the strategy the launcher set up and `world_size` the processes it started (the run passes both;
    `hftrain check` / `launch` / `config` pass neither, and the strategy is then strategy.name, or ddp as `hftrain
    launch` runs it, on strategy.num_processes processes). ZeRO-Infinity's swap buffers are sized here to the
    largest parameter partition. `environment=False` (`hftrain config`, which may render for another machine)
    leaves out what this machine says. `script` (`hftrain check`, `hftrain launch`: what the launch hands accelerate
    launch to run, `-m hftrain.recipes.sft` or a script's path) adds what `accelerate launch` itself would refuse of
    the launch (launch.libraries)."""
    recipe, problems = parse_recipe(path, overrides, raw)
    s = recipe.strategy
    if launcher is not None and s.name in STRATEGIES and s.name != launcher:
        problems.append(
            f"{recipe.where('strategy.name')}: strategy.name is '{s.name}' but the launcher set up '{launcher}'. "
            f"Launch with `--config_file accelerate_configs/{s.name}.yaml` (or `hftrain launch`), or set "
            f"strategy.name to '{launcher}', or remove strategy.name to let the launcher decide")
        raise RecipeError(problems)  # the rules below would judge a strategy that is not the one asked for
    if world_size is not None and _typed(s.num_processes, int) and s.num_processes != world_size:
        problems.append(
            f"{recipe.where('strategy.num_processes')}: strategy.num_processes is {s.num_processes} but the launcher "
            f"started {world_size} processes; launch with `hftrain launch` (or --num_processes {s.num_processes}), "
            "or remove strategy.num_processes to let the launcher decide")
    name = launcher or s.name or "ddp"
    if name not in STRATEGIES:  # a wrong strategy.name, already reported
        raise RecipeError(problems)
    if name != s.name:  # recipe_problems ran the strategy's rules only for a strategy the recipe names
        problems += [_message(recipe, k, m) for k, m in strategy_problems(recipe, name)]
    world = world_size or (s.num_processes if _typed(s.num_processes, int) else STRATEGY_DEFAULTS["num_processes"])
    sp = s.sequence_parallel if _typed(s.sequence_parallel, int) else 1
    if sp > 1 and world % sp and not _typed(s.num_processes, int):  # a set num_processes is judged by the rules
        problems.append(f"{recipe.where('strategy.sequence_parallel')}: strategy.sequence_parallel: {sp} must divide "
                        f"the {world} processes (data-parallel groups of {sp} ranks share each sequence); launch a "
                        f"multiple of {sp} processes")
    strategy = replace(s, name=name)
    problems += [_message(recipe, k, m) for k, m in libraries.moe_problems(recipe, world)]
    for section in recipe.method_sections().values():  # the method's own, over these processes and this machine
        problems += [_message(recipe, k, m) for k, m in section.launch_problems(recipe, world, environment)]
    if environment:
        # The run's own train() says what it accepts with a caveat (an unverified checkpoint); check and launch say it.
        warn = (lambda m: print(m, file=sys.stderr, flush=True)) if launcher is None else (lambda _m: None)
        env, strategy = environment_problems(recipe, strategy, world, skip=recipe.invalid, warn=warn)
        problems += env
    if environment and script and launcher is None and not problems:  # the launch itself, as accelerate will run it
        script = script(recipe) if callable(script) else script
        problems += [_message(recipe, k, m) for k, m in libraries.launch_problems(recipe, strategy, script)]
    if problems:
        raise RecipeError(problems)
    return recipe, strategy


def environment_problems(recipe: Recipe, strategy: StrategySection, world: int, skip: set[str] = frozenset(),
                         warn=lambda _m: None) -> tuple[list[str], StrategySection]:
    """What this machine says about the recipe: paths that cannot be loaded or written, a checkpoint that cannot be
    resumed, TrainingArguments' own rules, NVMe and DeepSpeed ops. Keys in `skip` already have a problem."""
    m = recipe.model
    model_ok = m is not None and _typed(m.name_or_path, str) and not any(k.startswith("model.") for k in skip)
    out = _model_problems(recipe, skip, model_ok) + _setting_problems(recipe, skip)
    strategy, machine = _machine_problems(recipe, strategy, world, skip, model_ok)
    out += machine + _output_problems(recipe, strategy, world, skip, model_ok, warn)
    return [_message(recipe, k, msg) for k, msg in out], strategy


def _model_problems(recipe: Recipe, skip: set[str], model_ok: bool) -> list[tuple[str, str]]:
    """The model's paths, the Trainer's and LoRA's own rules, the kernels and bitsandbytes."""
    out: list[tuple[str, str]] = []
    m = recipe.model
    template = recipe.data.chat_template if recipe.data is not None else None
    if model_ok:
        out += path_problems(m, template if isinstance(template, str) else None)
    if not any(k.startswith("training.") or k.startswith("model.") or k.startswith("data.") for k in skip) and (
            recipe.data is not None and m is not None):
        msg = arguments_problem(arguments_kwargs(recipe, accelerator_available()))
        if msg:
            out.append(("training", f"TrainingArguments refuses these values: {msg}"))
        else:  # what the Trainer, torch's DataLoader and the optimizer/scheduler factories would refuse in train()
            out += libraries.trainer_problems(recipe, accelerator_available())
    if model_ok and not any(k.startswith("model.lora") for k in skip):
        out += libraries.lora_problems(recipe)
    if model_ok and m.experts_implementation is not None and "model.experts_implementation" not in skip:
        out += libraries.experts_problems(recipe)
    if model_ok and recipe.training.get("loss_impl") == "fused" and "training.loss_impl" not in skip:
        out += libraries.fused_loss_problems(recipe)
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


def _setting_problems(recipe: Recipe, skip: set[str]) -> list[tuple[str, str]]:
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


def _machine_problems(recipe: Recipe, strategy: StrategySection, world: int, skip: set[str], model_ok: bool
                      ) -> tuple[StrategySection, list[tuple[str, str]]]:
    """The model's heads against sequence parallelism, NVMe's buffers sized to the model, and what this machine can
    run of the strategy; the strategy comes back with the sizes filled in."""
    out: list[tuple[str, str]] = []
    m = recipe.model
    sp = strategy.sequence_parallel if _typed(strategy.sequence_parallel, int) else 1
    heads = _heads_problem(m.name_or_path, m.trust_remote_code, sp) if model_ok and sp > 1 else None
    if heads:
        out.append(("strategy.sequence_parallel", heads))
    facts = None
    if strategy.name == "zero_infinity" and model_ok:
        facts = facts_or_none(m.name_or_path, m.trust_remote_code)
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


def _output_problems(recipe: Recipe, strategy: StrategySection, world: int, skip: set[str], model_ok: bool,
                     warn) -> list[tuple[str, str]]:
    """output_dir: writable, outside the inputs, owned by this run; the checkpoint to resume against this layout."""
    output_dir = recipe.training.get("output_dir")
    if not (_typed(output_dir, str) and output_dir and "training.output_dir" not in skip):
        return []
    where = output_dir_problems(output_dir, protected_folders(recipe) if model_ok else {})
    if not where and "training.overwrite_output_dir" not in skip:
        resume = bool(recipe.resume_from_checkpoint) or restart_count() > 0
        owned = outdir.ownership_problem(output_dir, resume, bool(recipe.training_value(outdir.OVERWRITE)))
        where = [owned] if owned else []
    out = [("training.output_dir", msg) for msg in where]
    if "training.resume_from_checkpoint" not in skip:
        sp = strategy.sequence_parallel if _typed(strategy.sequence_parallel, int) else 1
        ep = recipe.moe.expert_parallel_size if recipe.moe and _typed(recipe.moe.expert_parallel_size, int) else 1
        now = checkpoints.layout(world, recipe.training_value("per_device_train_batch_size"),
                                 recipe.training_value("gradient_accumulation_steps"), strategy.name, sp, ep)
        out += [("training.resume_from_checkpoint", msg)
                for msg in resume_problems(recipe.resume_from_checkpoint, output_dir, now,
                                           recipe.training_value("resume_weights_only") is True,
                                           recipe if model_ok else None, warn)]
    return out


def _heads_problem(name_or_path: str, trust_remote_code: bool, n: int) -> str | None:
    """sequence_parallel.heads_problem of the model's config, None when it cannot be read here (loading says so)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except Exception:
        return None
    return heads_problem(config, n)


def _strategy_key(msg: str) -> str:
    key = msg.split(":", 1)[0]
    return key if key.startswith("strategy.") else "strategy.name"


def batch_problem(world: int, per_device: int, accumulation: int, drop_last: bool, n_examples: int) -> str | None:
    """One optimizer step takes world x micro-batch x accumulation examples; fewer than that trains nothing."""
    need = world * per_device * accumulation
    if drop_last and n_examples < need:  # without drop_last a short step still trains
        return (f"one optimizer step needs {need} examples ({world} processes x per_device_train_batch_size "
                f"{per_device} x gradient_accumulation_steps {accumulation}) and dataloader_drop_last drops them "
                f"all: the data has {n_examples}. Lower one of those or add data")
    return None


def check_data(recipe: Recipe, world_size: int, seed: int | None = None):
    """(tokenizer, data): every row read, rendered and tokenised into the datasets cache, or found there (errors name
    the file and row), by the recipe's method (methods.Method.read), and one optimizer step's worth of rows present.
    `hftrain check`, `hftrain prepare` and the run share this phase, so a check or a prepare leaves the run a warm
    cache. With data.streaming the training rows are read as training goes: the first rows of each source are
    checked."""
    tokenizer = load_tokenizer(recipe.model, recipe.data.chat_template)
    seed = recipe.training_value("seed") if seed is None else seed
    method = method_of(recipe)
    data = method.read(recipe, tokenizer, world_size, seed)
    if method.counts_its_steps:
        return tokenizer, data
    if recipe.data.streaming:  # a stream has no length; its first rows were checked (data/stream.py)
        print0("hftrain: training examples streamed" + (f", {len(data.eval)} held out" if data.eval is not None
                                                         else ""))
        return tokenizer, data
    problem = batch_problem(world_size, recipe.training_value("per_device_train_batch_size"),
                            recipe.training_value("gradient_accumulation_steps"),
                            recipe.training_value("dataloader_drop_last"), len(data.train))
    if problem:
        raise LaunchError(problem)
    print0(f"hftrain: {len(data.train)} training {method.unit}"
           + (f", {len(data.eval)} held out" if data.eval is not None else ""))
    return tokenizer, data
