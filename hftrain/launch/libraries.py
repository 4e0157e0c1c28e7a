"""What the libraries would refuse at run time, asked of the libraries themselves before anything runs.

A recipe value that transformers, torch, datasets or accelerate refuses only once the run is under way (a negative
seed in set_seed, negative dataloader workers in DataLoader, eval.max_new_tokens in generate(), data.num_proc in
datasets' map, a port or a process count in the launcher) would stop the run with a traceback after the model has
loaded. Here each library runs its own validation on the recipe's values, the way the run will call it, and what it
refuses is reported with the key and the library's words, by `hftrain check`, `hftrain launch` and the run alike
(preflight.environment_problems). Nothing is kept by hand: a value is wrong when the library says so.

- `trainer_problems`: transformers' Trainer built around a stand-in model (one parameter) with the recipe's
  TrainingArguments, then its train/eval dataloaders, optimizer and scheduler: set_seed, torch's DataLoader, the
  optimizer and scheduler factories. Precision and strategy are left out (TrainingArguments' own check and the
  engine check judge them; a CPU stand-in cannot). The probe never starts a process group, writes nothing to
  output_dir, and leaves accelerate's shared state as it found it.
- `generation_problem`: transformers' GenerationConfig with the settings greedy answers pass to generate().
- `num_proc_problem`: datasets' map with data.num_proc, on an empty dataset.
- `launch_problems`: `accelerate launch` of the recipe's rendered launcher config, run as the launch will run it,
  through accelerate's argument checks and torch elastic's launch configuration, stopped just before torch's agent
  would start (nothing is bound, started or written but a temporary folder of its own).

Each refusal names the keys to blame: the keys of the recipe whose reset to the default makes the library accept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import tempfile
import warnings
from typing import Callable
from unittest import mock

import torch

from ..config import HFTrainingArguments, Recipe, StrategySection, arguments_kwargs
from ..config.strategy import STRATEGY_DEFAULTS
from ..config.training import NOT_ARGUMENTS, TRAINING_DEFAULTS
from ..evaluate import greedy_settings
from .machines import held_port_problem
from .strategies import render

# What a launcher exports to its workers; the probes run as one process of their own, whatever launched this one.
_LAUNCHER_VARIABLES = ("ACCELERATE_", "TORCHELASTIC_", "FSDP_", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                       "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_", "MASTER_ADDR", "MASTER_PORT")
# TrainingArguments keys the CPU stand-in cannot judge (TrainingArguments' own check and the engine check do).
_NOT_PROBED = ("fp16", "bf16", "tf32", "fp16_full_eval", "bf16_full_eval", "half_precision_backend", "deepspeed",
               "fsdp", "fsdp_config", "torch_compile", "torch_compile_backend", "torch_compile_mode", "use_cpu",
               "output_dir", "logging_dir", "push_to_hub", "hub_model_id", "report_to")


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def blame(keys: dict[str, Callable[[], str | None]]) -> list[str]:
    """The keys whose reset alone makes the refusal go away (each callable re-asks the library without that key)."""
    return [key for key, retry in keys.items() if retry() is None]


@contextlib.contextmanager
def single_process():
    """This process as a plain single process for the duration (no launcher variables, so nothing starts a process
    group), with accelerate's shared state (PartialState, AcceleratorState, GradientState) put back afterwards: the
    run's own Accelerator must not inherit the probe's."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    saved = [(cls, dict(cls._shared_state)) for cls in (PartialState, AcceleratorState, GradientState)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARIABLES)}
    try:
        # stdout is what `hftrain check` prints the resolved recipe on: libraries imported here (DeepSpeed's
        # accelerator detection, through accelerate) say their piece on stderr instead.
        with mock.patch.dict(os.environ, env, clear=True), warnings.catch_warnings(), quiet(), \
                contextlib.redirect_stdout(sys.stderr):
            warnings.simplefilter("ignore")
            yield
    finally:
        for cls, state in saved:
            cls._shared_state.clear()
            cls._shared_state.update(state)


@contextlib.contextmanager
def quiet():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    loggers = [logging.getLogger(n) for n in ("accelerate", "torch.distributed.elastic", "torch.distributed.run")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


# -- transformers' Trainer --------------------------------------------------------------------------------------
class _StandIn(torch.nn.Module):
    """One parameter and a config: enough for the Trainer to build its dataloaders, optimizer and scheduler (it reads
    the model's config for some arguments: training.label_smoothing_factor, its problem_type)."""

    def __init__(self):
        from transformers import PretrainedConfig

        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = PretrainedConfig()

    def forward(self, input_ids=None, labels=None, **kwargs):
        return {"loss": self.weight.sum()}


def _probe_trainer(kwargs: dict, has_eval: bool) -> str | None:
    import datasets
    from transformers import Trainer

    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2]] * 8, "labels": [[1, 2]] * 8})
    probed = {k: v for k, v in kwargs.items() if k not in _NOT_PROBED}
    try:
        with single_process(), tempfile.TemporaryDirectory(prefix="hftrain-probe-") as tmp:
            # The run's own arguments (TrainingArguments with hftrain's typed options): in this single process its
            # device resolves without a process group.
            args = HFTrainingArguments(output_dir=tmp, use_cpu=True, report_to="none", **probed)
            trainer = Trainer(model=_StandIn(), args=args, train_dataset=rows, eval_dataset=rows if has_eval else None)
            trainer.get_train_dataloader()
            if has_eval:
                trainer.get_eval_dataloader()
            trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps if args.max_steps > 0 else 10)
    except Exception as e:  # whatever the libraries raise for these values is the user's to fix
        return one_line(e)
    return None


def trainer_problems(recipe: Recipe, accelerator: bool) -> list[tuple[str, str]]:
    """(key, problem) for what transformers' Trainer, torch's DataLoader and the optimizer/scheduler factories refuse
    among the recipe's training: values (TrainingArguments' own check has passed)."""
    has_eval = bool(recipe.data.eval_sources) or (isinstance(recipe.data.eval_fraction, float)
                                                  and recipe.data.eval_fraction > 0)
    kwargs = arguments_kwargs(recipe, accelerator)
    why = _probe_trainer(kwargs, has_eval)
    if why is None:
        return []
    set_keys = [k for k, v in recipe.training.items() if k not in NOT_ARGUMENTS and k not in _NOT_PROBED
                and (k not in TRAINING_DEFAULTS or TRAINING_DEFAULTS[k] != v)]

    def without(key):
        reset = {k: v for k, v in kwargs.items() if k != key}
        if key in TRAINING_DEFAULTS:
            reset[key] = TRAINING_DEFAULTS[key]
        return lambda: _probe_trainer(reset, has_eval)

    keys = blame({k: without(k) for k in set_keys})
    named = ", ".join(f"training.{k} ({recipe.training[k]!r})" for k in keys)
    return [(f"training.{keys[0]}" if keys else "training",
             f"{named or 'training'}: transformers' Trainer refuses {'it' if len(keys) == 1 else 'these values'} "
             f"({why}); change {'it' if len(keys) == 1 else 'them'} to a value it accepts")]


# -- generation ---------------------------------------------------------------------------------------------------
def generation_problem(max_new_tokens) -> str | None:
    """transformers' GenerationConfig with what greedy answers pass to generate() (evaluate.greedy_settings)."""
    from transformers import GenerationConfig

    try:
        with warnings.catch_warnings(), quiet():
            warnings.simplefilter("ignore")
            GenerationConfig().update(**greedy_settings(max_new_tokens))
    except Exception as e:
        return (f"eval.max_new_tokens: transformers' generate() refuses {max_new_tokens!r} ({one_line(e)}); set a "
                "number of tokens > 0")
    return None


# -- datasets ------------------------------------------------------------------------------------------------------
def num_proc_problem(num_proc) -> str | None:
    """datasets' map with data.num_proc (it validates before looking at the rows: an empty dataset costs nothing)."""
    import datasets

    if num_proc is None:
        return None
    try:
        datasets.Dataset.from_dict({"x": []}).map(lambda row: row, num_proc=num_proc)
    except Exception as e:
        return (f"data.num_proc: datasets' map refuses {num_proc!r} ({one_line(e)}); set a number of processes "
                ">= 1, or remove it")
    return None


# -- the launcher ---------------------------------------------------------------------------------------------------
class _Stop(Exception):
    """Raised where torch elastic's agent would start: every check of the launch has run by then."""


def _try_launch(recipe: Recipe, strategy: StrategySection, script: list[str]) -> str | None:
    from accelerate.commands.launch import launch_command, launch_command_parser

    try:
        # The port is judged by held_port_problem, once and named: accelerate's own look at it (a port in use on
        # machine 0) would be blamed on whichever key's reset happens to pick another port.
        with single_process(), tempfile.TemporaryDirectory(prefix="hftrain-launch-check-") as tmp, \
                mock.patch("torch.distributed.launcher.api.LocalElasticAgent", side_effect=_Stop), \
                mock.patch("accelerate.utils.launch.is_port_in_use", return_value=False):
            config = render(strategy, tmp, recipe.training, communication_data_type=recipe.compression.reduce_dtype())
            args = launch_command_parser().parse_args(["--config_file", config[0], *script, recipe.source])
            launch_command(args)
    except _Stop:
        return None
    except SystemExit as e:  # argparse and the launcher's own exits
        return f"SystemExit({e.code})"
    except Exception as e:
        return one_line(e)
    return None


STRATEGY_KEYS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port")


def launch_problems(recipe: Recipe, strategy: StrategySection, script: list[str]) -> list[tuple[str, str]]:
    """(key, problem) for what `accelerate launch` would refuse of this recipe's launch (as `hftrain launch` runs it),
    found by running accelerate's launch command up to the point where torch elastic's agent would start; and machine
    0's rendezvous port, where another process of this machine holds it."""
    held = _held_port(strategy)
    why = _try_launch(recipe, strategy, script)
    if why is None:
        return held
    retries = {f"strategy.{k}": (lambda k=k: _try_launch(recipe, dataclasses.replace(
        strategy, **{k: None if k != "num_processes" else STRATEGY_DEFAULTS["num_processes"]}), script))
               for k in STRATEGY_KEYS if getattr(strategy, k) is not None}
    keys = blame(retries)
    named = ", ".join(f"{k} ({getattr(strategy, k.split('.', 1)[1])!r})" for k in keys)
    refuses = f"accelerate launch refuses {'it' if len(keys) == 1 else 'this launch'} ({why})"
    return held + [(keys[0] if keys else "strategy.name",
                    f"{named or 'strategy'}: {refuses}; "
                    f"change {'it' if len(keys) == 1 else 'them'} to a value it accepts")]


def _held_port(strategy: StrategySection) -> list[tuple[str, str]]:
    """held_port_problem of the launch, where the launch can start at all: on several machines without this
    machine's rank or machine 0's address, `hftrain launch` refuses it before any port matters."""
    if (strategy.num_machines or 1) > 1 and (strategy.machine_rank is None or not strategy.main_process_ip):
        return []
    port, machines, rank = (STRATEGY_DEFAULTS[k] if getattr(strategy, k) is None else getattr(strategy, k)
                            for k in ("main_process_port", "num_machines", "machine_rank"))
    problem = held_port_problem(port, machines, rank, chosen=strategy.main_process_port is not None)
    return [problem] if problem else []
