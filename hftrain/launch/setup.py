"""Setting up this process for a run: the one function that changes the process, called once by a recipe script.

`setup_run(argv)` reads the launcher's strategy, runs the one validation path (preflight.check_recipe) with it,
then exports what the engines read (FSDP_* variables, the DeepSpeed op cache), applies the library patches the
strategy needs, builds TrainingArguments (which starts the process group) and checks the world it got.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import TrainingArguments, set_seed

from .. import checkpoints
from ..config import (HFTrainingArguments, Recipe, StrategySection, arguments_kwargs, split_argv,
                      strategy_of_deepspeed_config)
from ..config.strategy import STRATEGY_DEFAULTS
from ..constants import ZERO_STAGE
from .. import outdir, stop_request
from ..distributed import (accelerator_available, all_gather_object, barrier, elastic_restart_count,
                           is_local_main_process, is_main_process, launcher_world_size, print0, restart_count,
                           world_size)
from ..errors import LaunchError, RecipeError, UserError
from ..methods import DEFAULT_SCRIPT, METHODS, method_of
from ..methods.frozen import reference_per_layer
from ..lifetime import (die_with_parent, end_on_interrupt, end_on_terminate, launched_by_a_launcher,
                        start_heartbeat)
from .. import sequence_parallel
from ..mesh import launcher_mesh_problem, parallelism_config
from ..patches.accelerate import apply_fsdp_on_cpu, apply_tensor_parallel_on_cpu
from ..patches.deepspeed import average_gradients_over_sequence_ranks, share_fp32_master_with_fp32_weights
from ..patches.transformers import skip_batches_of_sequence_shards
from ..patches.trl import place_references_with
from .network import export_socket_environment
from .machine import extensions_dir
from .op_cache import settle_build_locks
from .output_checks import protected_folders
from .preflight import check_recipe
from .strategies import deepspeed_config, render


@dataclass
class Run:
    recipe: Recipe
    strategy: StrategySection  # the strategy the launcher set up, with the recipe's options
    args: TrainingArguments


def launcher_strategy() -> str | None:
    """The strategy the launcher set up, read from the environment accelerate's launcher exports; None under
    DeepSpeed's launcher (`deepspeed`, which exports CROSS_RANK): it sets up no engine, the recipe's strategy
    decides (its DeepSpeed config goes to TrainingArguments)."""
    env = os.environ
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                return strategy_of_deepspeed_config(json.load(fh))
        return f"zero{env.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '')}"
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "fsdp"
    if "CROSS_RANK" in env and "LOCAL_SIZE" in env:  # deepspeed.launcher.launch's variables
        return None
    return "ddp"


def run_arguments(recipe: Recipe, strategy: StrategySection | None = None, resume: str | None = None, **extra) -> dict:
    """Every keyword of a run's arguments (config.HFTrainingArguments or a TRL config with HFTrainOptions): the
    recipe's `training:` values, the strategy and compression the trainer checks and applies, the checkpoint to
    resume from (resolved), and the strategy's `extra` (the DeepSpeed config)."""
    kwargs = arguments_kwargs(recipe, accelerator_available())
    kwargs.update(strategy_name=strategy.name if strategy is not None else None, resume_from_checkpoint=resume,
                  compression=dataclasses.asdict(recipe.compression),
                  part_learning_rates=dict(recipe.model.part_learning_rates) or None, **extra)
    return kwargs


def training_arguments(recipe: Recipe, **extra) -> HFTrainingArguments:
    """The arguments of an SFT run of a recipe outside a launcher (tests, benchmarks): no strategy check, no resume.
    Under a launcher this starts the process group (TrainingArguments resolves its device)."""
    return HFTrainingArguments(**run_arguments(recipe, **extra))


def _script_fits(recipe: Recipe, script: str) -> None:
    """The recipe script run (`hftrain <script>`) is the one its method needs: a preference: or grpo: section run by
    another script, or a script run without its section, is refused naming the right one."""
    method = method_of(recipe)
    if method.script != script:
        raise RecipeError([f"{recipe.source}: {method.section}: this recipe has a {method.section}: section: run it "
                           f"with `hftrain {method.script}` (recipes/{method.script}.py)"] if method.section else
                          [f"{recipe.source}: {_section_of(script)}: `hftrain {script}` (recipes/{script}.py) needs a "
                           f"{_section_of(script)}: section (e.g. {_example_of(script)})"])


def _section_of(script: str) -> str:
    return next(m.section for m in METHODS if m.script == script and m.section)


def _example_of(script: str) -> str:
    return next(m.example for m in METHODS if m.script == script and m.example)


def setup_run(argv: list[str], script: str = DEFAULT_SCRIPT, raw: dict | None = None) -> Run:
    """Validate, then set this process up: environment, patches, process group, the run's arguments, seed.

    The launcher decides processes and the engine family; the recipe's `strategy:` options apply on top (for ZeRO
    the DeepSpeed config is rendered from the recipe and given to the arguments, for FSDP the options go into
    the FSDP_* variables accelerate reads). `argv` is the recipe path and overrides; with `raw` (a recipe as a
    dict, for tests and benchmarks) it holds overrides only. `script` is the recipe script run (`hftrain <script>`),
    which must be the one the recipe's method needs: "dpo" needs a `preference:` section, the others refuse one
    (likewise "grpo" and a `grpo:` section). The method builds the arguments once (`Method.arguments`); the
    checkpoint to resume from is resolved here, once."""
    _handle_signals()
    path, overrides = (None, argv) if raw is not None else split_argv(argv)
    recipe, strategy = check_recipe(path, overrides, raw=raw, launcher=launcher_strategy(),
                                    world_size=launcher_world_size())
    _script_fits(recipe, script)
    export_socket_environment(strategy)  # strategy.socket_ifname, for gloo / NCCL: before the process group starts
    _isolate_restart_attempt()  # before TrainingArguments starts torch.distributed
    recipe, extra = _prepare_strategy(recipe, strategy)
    kwargs = run_arguments(recipe, strategy, _resume_from(recipe), **extra)
    args = method_of(recipe).arguments(recipe, **kwargs)
    _start_engine(strategy, args)
    set_seed(args.seed)
    return Run(recipe, strategy, args)


def _handle_signals() -> None:
    if launched_by_a_launcher():  # first: a worker must not outlive its launcher (hftrain/lifetime.py says why)
        die_with_parent()
        end_on_interrupt()
    else:  # a run of its own: SIGTERM ends it like Ctrl-C, status 143 and one line (errors.exit_on_user_error)
        end_on_terminate()
    stop_request.arm()  # SIGUSR1 (SLURM's warning before a time limit): save a checkpoint and stop, not die


def _prepare_strategy(recipe: Recipe, strategy: StrategySection) -> tuple[Recipe, dict]:
    """The process set up for the strategy before TrainingArguments: environment and patches; the recipe (its
    attention named under sequence parallelism) and the arguments' extra values (the DeepSpeed config, the
    parallelism config)."""
    extra = {}
    if strategy.name in ZERO_STAGE:
        prepare_op_cache()
        share_fp32_master_with_fp32_weights()
        extra["deepspeed"] = deepspeed_config(strategy, recipe.compression.reduce_dtype())
    _check_launcher_sequence_parallel(strategy)
    if strategy.resolved_sequence_parallel() > 1:
        # Ulysses wraps the kernel the model was loaded with, and DeepSpeed checks they agree: name it (sdpa unset).
        recipe = dataclasses.replace(recipe, model=dataclasses.replace(
            recipe.model, attn_implementation=recipe.model.attn_implementation or "sdpa"))
        extra["parallelism_config"] = sequence_parallel.parallelism_config(
            strategy.sequence_parallel, recipe.model.attn_implementation)
        average_gradients_over_sequence_ranks()
        skip_batches_of_sequence_shards()
    if strategy.resolved_tensor_parallel() > 1 and not accelerator_available():
        apply_tensor_parallel_on_cpu()  # transformers splits the model at load time; accelerate refuses it on CPU
    if strategy.name == "fsdp":
        _prepare_fsdp(strategy)
        if strategy.mesh().beyond_sharding:  # HSDP, TP, CP: the recipe's device mesh, never the launcher's alone
            extra["parallelism_config"] = parallelism_config(strategy.mesh())
        place_references_with(reference_per_layer)  # TRL's reference copies sharded per layer, as the plan counts
    return recipe, extra


def prepare_op_cache() -> None:
    """DeepSpeed JIT-builds its ops into hftrain's cache (machine.extensions_dir); the locks a stopped build left there,
    on which torch would wait forever without a word, are released, and another run's build waited for, before
    this run's process group starts (launch.op_cache): no build of this run can be going on yet."""
    root = os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir()
    settle_build_locks(root, say=lambda message: print(f"hftrain: {message}", flush=True))


def _prepare_fsdp(strategy: StrategySection) -> None:
    """The recipe's FSDP options as the FSDP_* variables accelerate reads; FSDP2 on CPU patched to run."""
    for key, env in (("fsdp_reshard_after_forward", "FSDP_RESHARD_AFTER_FORWARD"),
                     ("fsdp_offload_params", "FSDP_OFFLOAD_PARAMS")):
        if getattr(strategy, key) is not None:
            os.environ[env] = str(getattr(strategy, key)).lower()
    if strategy.fsdp_wrap_class:
        os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"] = strategy.fsdp_wrap_class
    if not accelerator_available():
        apply_fsdp_on_cpu()


def _resume_from(recipe: Recipe) -> str | None:
    """The checkpoint to resume from, resolved once (a restarted worker resumes from the last one)."""
    resume = checkpoints.resolve_resume(recipe.resume_from_checkpoint, recipe.output_dir, restart_count() > 0,
                                        warn=print0, weights_only=recipe.typed_training.resume_weights_only is True)
    if resume and restart_count() > 0 and not recipe.resume_from_checkpoint:
        print0(f"hftrain: {_restarted_by()}: resuming from {resume}")
    return resume


def _start_engine(strategy: StrategySection, args) -> None:
    """DeepSpeed's comm layer, the world the arguments see checked against the launcher's, the heartbeat."""
    if strategy.name in ZERO_STAGE:
        import deepspeed  # optional dependency: only ZeRO strategies need it

        # DeepSpeed's comm layer must exist before the model is built (ZeRO-3's zero.Init); on CPU it runs on gloo.
        deepspeed.init_distributed("nccl" if accelerator_available() else "gloo")
    if args.world_size != launcher_world_size():
        raise LaunchError(
            f"the launcher started {launcher_world_size()} processes but training sees a world of {args.world_size}: "
            "the ranks would train separate copies. On a machine without GPU leave training.use_cpu unset (hftrain "
            "sets it) and launch with torchrun or a MULTI_GPU accelerate config")
    # A stalled rank fails the job by name within strategy.rank_timeout (the process group's own timeout,
    # training.ddp_timeout, is left alone: it bounds one collective, and may well be longer on purpose).
    timeout = strategy.rank_timeout if strategy.rank_timeout is not None else STRATEGY_DEFAULTS["rank_timeout"]
    start_heartbeat(timeout)


def _check_launcher_sequence_parallel(strategy: StrategySection) -> None:
    """A launcher config with a parallelism_config (accelerate exports PARALLELISM_CONFIG_*) makes accelerate build
    sequence parallelism the trainer knows nothing of when the arguments carry none: hftrain takes it from the
    recipe only, and refuses a launcher that disagrees."""
    env = os.environ
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() != "true":
        return
    mesh_problem = launcher_mesh_problem(strategy.mesh(), env) if strategy.name == "fsdp" else None
    if mesh_problem:
        raise LaunchError(mesh_problem)
    launched = int(env.get("PARALLELISM_CONFIG_SP_SIZE", "1") or 1)
    if launched != strategy.resolved_sequence_parallel():
        raise LaunchError(f"the launcher's config asks for sequence parallelism of {launched} but the recipe's "
                          f"strategy.sequence_parallel is {strategy.resolved_sequence_parallel()}: hftrain takes it "
                          "from the recipe; remove parallelism_config from the accelerate config (or launch with "
                          "`hftrain launch`) and set strategy.sequence_parallel")


def write_strategy_configs(recipe: Recipe, strategy: StrategySection) -> list[str]:
    """The accelerate config (and DeepSpeed JSON) of this run, rendered from the recipe, in output_dir."""
    return render(strategy, recipe.output_dir, recipe.training,
                  communication_data_type=recipe.compression.reduce_dtype())


def claim_output_dir(recipe: Recipe) -> None:
    """After every check has passed and immediately before anything is written to output_dir: the main process takes
    output_dir's lock for the run's lifetime and, under it, checks the folder again (outdir.claim: another run may have
    finished there since the preflight looked); with training.overwrite_output_dir it then clears the previous run's
    checkpoints. Every rank calls this: a refusal reaches every rank as the same error (exit 2 on each), not only the
    main process."""
    problem = None
    if is_main_process():
        resumed = bool(recipe.resume_from_checkpoint) or restart_count() > 0
        try:
            outdir.claim(recipe.output_dir, bool(recipe.typed_training.overwrite_output_dir), resumed, say=print0,
                         protected=protected_folders(recipe))
        except UserError as e:
            problem = str(e)
    if world_size() > 1:
        problem = all_gather_object(problem)[0]  # the main process's verdict, on every rank
    if problem:
        raise LaunchError(problem)
    _check_shared_output_dir(recipe.output_dir)


def _check_shared_output_dir(path: str) -> None:
    """Several machines write one run into output_dir (the model and manifests from global rank 0, each rank's RNG
    state into every checkpoint), so it must be one folder that all of them see: a folder of the same name on each
    machine would split every checkpoint between machines, none complete. The first process of each machine reads
    the lock line the main process just wrote (after a barrier); a machine that sees another line, or none, is named,
    and every rank stops with the same error before anything else is written."""
    world = world_size()
    if world <= 1 or int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world:
        return  # one machine
    barrier()
    seen = outdir.lock_line(path) if is_local_main_process() else ""
    views = all_gather_object((socket.gethostname(), seen))
    bad = [f"rank {r} on {host} ({'no lock file' if line is None else 'another run: ' + line[:80]})"
           for r, (host, line) in enumerate(views) if line != "" and line != views[0][1]]
    if bad:
        raise LaunchError(f"training.output_dir: {path} is not the same folder on every machine: {'; '.join(bad)} "
                          f"does not see the one the main process ({views[0][0]}) locked. Several machines must "
                          "share output_dir (a network filesystem mounted at the same path on each), or each "
                          "checkpoint would be split between them; point training.output_dir at a shared mount")


def _isolate_restart_attempt() -> None:
    """After an elastic restart, start the process group on a store prefixed by the attempt number: torchrun's static
    rendezvous hands restarted workers the first attempt's store unprefixed, so the new group can read the dead
    attempt's addresses ("connectFullMesh ... Connection refused"). Runs before accelerate creates the group."""
    attempt = elastic_restart_count()  # a requeued SLURM job starts a new launcher, with a new store
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return
    world, rank_ = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(minutes=30))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank_, world_size=world,
                            store=dist.PrefixStore(f"hftrain/attempt_{attempt}", store))
    print0(f"hftrain: restart {attempt}: process group on a fresh store prefix")


def _restarted_by() -> str:
    """Who started this run again: the launcher's restart, or SLURM's requeue of the job."""
    return "restarted by the launcher" if elastic_restart_count() else "the job was requeued by SLURM"
