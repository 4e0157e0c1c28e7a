"""The `hftrain` command: `check` a recipe, `prepare` or show its `data`, render its strategy `config`, `plan` memory,
`launch`, `push`, `tiny-model`, `moe upcycle`."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from dataclasses import replace

from . import lifetime
from .config import RecipeError, StrategySection
from .config.strategy import STRATEGY_DEFAULTS, resolved_strategy
from .constants import STRATEGIES
from .errors import LaunchError, exit_on_user_error
from .fileio import atomic_write
from .hub.push import push
from .hub.run_settings import run_recipe, settings_for_run
from .data.cache import cache_folder
from .launch import check_data, check_recipe, machines
from .launch.machines import check_in
from .launch.plan import GiB, format_plan, kernels_here, model_facts, plan
from .launch.slurm import LAUNCHERS, prepare_log_folder, slurm_script
from .launch.strategies import render, run_files_rewritten
from .methods import DEFAULT_SCRIPT, METHODS, SCRIPTS, entry_of, load_recipe, method_of, policy_head
from .modeling import load_tokenizer
from .moe.upcycle import upcycle_folder
from .tiny import add_tiny_model_command


def script_for(recipe, kind: str | None = None, script: str | None = None) -> list[str]:
    """What `hftrain launch` (sft, dpo) hands accelerate launch to run: a script of the user's own, else the recipe's
    method as a module of the package (hftrain/recipes/: dpo for a recipe with a preference: section, grpo for one
    with a grpo: section, else sft)."""
    if script:
        return [script]
    return ["-m", f"hftrain.recipes.{kind or entry_of(recipe).script}"]


def _check(ns) -> int:
    recipe, strategy = check_recipe(ns.recipe, ns.overrides, script=script_for)
    if not ns.no_data:
        world = strategy.num_processes or STRATEGY_DEFAULTS["num_processes"]
        check_data(recipe, world // strategy.resolved_sequence_parallel())  # data-parallel ranks
    print(recipe.to_yaml(), end="")
    return 0


def _prepare(ns) -> int:
    recipe, strategy = check_recipe(ns.recipe, ns.overrides)
    start = time.monotonic()
    check_data(recipe, strategy.num_processes or STRATEGY_DEFAULTS["num_processes"])
    what = "eval sources (training rows stream)" if recipe.data.streaming else "data"
    print(f"hftrain: {what} prepared in {time.monotonic() - start:.1f} s, cached under {cache_folder()} (the run "
          "memory-maps it; HF_DATASETS_CACHE moves it)")
    return 0


def _data(ns) -> int:
    recipe, _ = check_recipe(ns.recipe, ns.overrides)
    tokenizer = load_tokenizer(recipe.model, recipe.data.chat_template)
    print(method_of(recipe).show(recipe, tokenizer, ns.examples))  # as the method's trainer gets its rows
    return 0


def _config(ns) -> int:
    training, comm_dtype, overrides = None, None, list(ns.overrides)
    if not ns.slurm and (ns.launcher or ns.script):
        raise RecipeError(["command line: --launcher and --script shape the SLURM script: add --slurm"])
    if ns.recipe:
        if ns.strategy:
            overrides.append(f"strategy.name={ns.strategy}")
        recipe, strategy = check_recipe(ns.recipe, overrides, environment=False)
        if recipe.strategy.name is None:
            raise RecipeError([f"{ns.recipe}: strategy.name is unset; set it in the recipe or pass --strategy NAME"])
        training, comm_dtype = recipe.training, recipe.compression.reduce_dtype()
        out = ns.output or recipe.output_dir
        names = [strategy.name]
    else:
        if ns.overrides:
            raise RecipeError(["command line: overrides need a recipe: hftrain config RECIPE key=value ..."])
        if not ns.strategy and not ns.all:
            raise RecipeError(["command line: give a recipe, --strategy NAME or --all"])
        names = list(STRATEGIES) if ns.all else [ns.strategy]
        strategy, out = StrategySection(), ns.output or "accelerate_configs"
    for name in names:
        changed = run_files_rewritten(replace(strategy, name=name), out, training, comm_dtype)
        if changed:
            raise RecipeError([f"{out} holds a run, and rendering there would rewrite the launcher config it wrote for "
                               f"itself ({', '.join(changed)}): render into another folder with --output DIR"])
        written = render(replace(strategy, name=name), out, training, communication_data_type=comm_dtype)
        if ns.slurm:
            if not ns.recipe:
                raise RecipeError(["command line: --slurm needs a recipe: hftrain config RECIPE --slurm"])
            path = os.path.join(out, "launch.sbatch")
            atomic_write(path, slurm_script(recipe, replace(strategy, name=name), ns.recipe, ns.overrides,
                                            config_path=written[0], launcher=ns.launcher or "accelerate",
                                            script=ns.script,
                                            path=path))
            os.chmod(path, 0o755)
            written += [path, prepare_log_folder(recipe)]
        for path in written:
            print(f"hftrain: wrote {path}")
    return 0


def _launch(ns) -> int:
    overrides = list(ns.overrides) + ([f"strategy.machine_rank={ns.machine_rank}"] if ns.machine_rank is not None
                                      else [])
    kind = getattr(ns, "kind", None)
    recipe, strategy = check_recipe(ns.recipe, overrides, script=lambda r: script_for(r, kind, ns.script))
    s = resolved_strategy(strategy)
    if s.num_machines > 1 and not s.main_process_ip:
        raise LaunchError(f"{ns.recipe}: strategy.num_machines is {s.num_machines} but strategy.main_process_ip is "
                          "unset: set it to machine 0's address (the same on every machine), e.g. "
                          "strategy.main_process_ip=10.0.0.1")
    if s.num_machines > 1 and strategy.machine_rank is None:
        raise LaunchError(f"{ns.recipe}: strategy.num_machines is {s.num_machines} but this machine's rank is unset: "
                          "left out, every machine would take rank 0. Run `hftrain launch ... --machine-rank K` on "
                          f"machine K (0 on the machine at {s.main_process_ip}, "
                          f"1 .. {s.num_machines - 1} on the others)")
    if s.num_machines > 1 and not ns.dry_run:  # every machine checks in with machine 0: a wrong rank fails here
        check_in(s.main_process_ip, s.main_process_port, s.machine_rank, s.num_machines,
                 s.rank_timeout or machines.DEFAULT_TIMEOUT, say=lambda m: print(m, flush=True))
    # The launcher's config goes into a folder of this launch's own, not output_dir: nothing is written there before
    # the run's own checks pass (the run writes its resolved configs itself, on the main process), and machines
    # sharing output_dir cannot overwrite each other's machine_rank.
    with tempfile.TemporaryDirectory(prefix=f"hftrain-launch-node{s.machine_rank}-") as tmp:
        config = render(strategy, tmp, recipe.training, communication_data_type=recipe.compression.reduce_dtype())[0]
        # accelerate's launch command, ending on a signal or a failed worker with a status, not a traceback
        cmd = [sys.executable, "-m", "hftrain.launch.launcher", "--config_file", config]
        if ns.max_restarts:
            cmd += ["--max_restarts", str(ns.max_restarts)]
        # The recipe scripts ship in the package (hftrain/recipes/): run as modules, they work from any folder.
        cmd += [*script_for(recipe, kind, ns.script), ns.recipe, *overrides, f"strategy.name={strategy.name}"]
        print("hftrain: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
        if ns.dry_run:
            with open(config, encoding="utf-8") as fh:
                print(fh.read(), end="")
            return 0
        return lifetime.run_owned(cmd)


def _plan(ns) -> int:
    recipe = load_recipe(ns.recipe, ns.overrides)
    m, micro = recipe.model, recipe.training_value("per_device_train_batch_size")
    facts = model_facts(m.name_or_path, m.lora.r if m.lora else None, m.trust_remote_code, m.dtype,
                        quantization=m.quantization, head=policy_head(recipe))
    sp = recipe.strategy.resolved_sequence_parallel()
    rows = plan(facts, ns.gpus_per_node, ns.nodes, micro, recipe.data.max_length, m.gradient_checkpointing,
                bool(recipe.training_value("bf16") or recipe.training_value("fp16")), sp)
    active = f" ({facts.active_params / 1e6:.1f}M active per token)" if facts.active_params != facts.params else ""
    print(f"{m.name_or_path}: {facts.params / 1e6:.1f}M parameters{active}, {facts.trainable / 1e6:.1f}M trained; "
          f"{ns.gpus_per_node} GPU(s) x {ns.nodes} node(s); micro-batch {micro} x {recipe.data.max_length} tokens"
          + (f", each sequence split across {sp} GPUs" if sp > 1 else ""))
    print(format_plan(rows, ns.gpu_memory * GiB if ns.gpu_memory else None, sp), kernels_here(m, facts), sep="\n")
    return 0


def _push(ns) -> int:
    recipe = load_recipe(run_recipe(ns.output_dir))
    hub = settings_for_run(recipe, repo_id=ns.repo_id, private=ns.private or None, revision=ns.revision,
                           commit_message=ns.commit_message, merge_lora=ns.merge_lora or None, license=ns.license)
    push(ns.output_dir, hub, dry_run=ns.dry_run, stage_dir=ns.stage_dir,
         trust_remote_code=recipe.model.trust_remote_code)
    return 0


def _moe_upcycle(ns) -> int:
    out = upcycle_folder(ns.model, ns.output, ns.num_experts, ns.top_k, ns.layers, ns.router_init_std, ns.seed)
    print(f"hftrain: upcycled {ns.model} to {ns.num_experts} experts (top-{ns.top_k}) in {out}")
    return 0


def _recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")


def _add_check(sub) -> None:
    c = sub.add_parser("check", allow_abbrev=False,
                       help="Validate a recipe as the run would (every problem at once: the recipe, its strategy, "
                       "paths, output_dir, resume, NVMe; then every data row), and print it resolved.")
    _recipe_arguments(c)
    c.add_argument("--no-data", dest="no_data", action="store_true",
                   help="skip the data phase (tokenizer and every row of every source)")
    c.set_defaults(fn=_check)


def _add_prepare(sub) -> None:
    pr = sub.add_parser("prepare", allow_abbrev=False,
                        help="Read and tokenise the recipe's data into the datasets cache ahead of the job, with "
                        "data.num_proc processes (default: the cores available); the run then only memory-maps it. "
                        "On a shared filesystem the whole job reuses it.")
    _recipe_arguments(pr)
    pr.set_defaults(fn=_prepare)


def _add_data(sub) -> None:
    d = sub.add_parser("data", allow_abbrev=False,
                       help="Show what the recipe trains on: per source its layout, token counts, truncation and "
                       "drops (from the prepared data, prepared first if need be; streaming: the first rows), and its "
                       "first examples rendered with the trained tokens between [[ and ]].")
    _recipe_arguments(d)
    d.add_argument("--examples", type=int, default=2, help="rendered examples per source (default 2)")
    d.set_defaults(fn=_data)


def _add_config(sub) -> None:
    g = sub.add_parser("config", allow_abbrev=False,
                       help="Write the accelerate config (and DeepSpeed JSON) for a recipe's strategy, or for "
                       "--strategy NAME / --all.")
    g.add_argument("recipe", nargs="?", help="recipe YAML (optional)")
    g.add_argument("overrides", nargs="*", help="section.key=value overrides")
    g.add_argument("--strategy", choices=STRATEGIES)
    g.add_argument("--all", action="store_true", help="every strategy (how accelerate_configs/ is made)")
    g.add_argument("--output", help="folder to write to (default: the recipe's output_dir, or accelerate_configs)")
    g.add_argument("--slurm", action="store_true", help="also write launch.sbatch, the SLURM job: one launcher per "
                   "node, logs in OUTPUT_DIR/slurm, a checkpoint and a requeue before the time limit")
    g.add_argument("--launcher", choices=LAUNCHERS, default=None,
                   help="--slurm: the launcher each node runs (torchrun: ddp; deepspeed: zero*; default accelerate)")
    g.add_argument("--script", default=None, help="--slurm: a training script of your own instead of the recipe's "
                   "method")
    g.set_defaults(fn=_config)


def _add_plan(sub) -> None:
    pl = sub.add_parser("plan", allow_abbrev=False,
                        help="Memory per GPU / node for every strategy, what fits, and a recommendation.")
    _recipe_arguments(pl)
    pl.add_argument("--gpus-per-node", dest="gpus_per_node", type=int, default=8)
    pl.add_argument("--nodes", type=int, default=1)
    pl.add_argument("--gpu-memory", dest="gpu_memory", type=float, default=None, help="GiB per GPU")
    pl.set_defaults(fn=_plan)


def _training_commands() -> list[tuple[str, str]]:
    """`hftrain launch` (the recipe's method) and one command per recipe script, described from the registry."""
    by_section: dict[str | None, list[str]] = {}
    for m in METHODS:
        by_section.setdefault(m.section, []).append(m.name)
    chosen = "; ".join(f"a {section}: section: {', '.join(names)}" for section, names in by_section.items() if section)
    commands = [("launch", f"the recipe's method ({chosen}; else {DEFAULT_SCRIPT})")]
    for script in reversed(SCRIPTS):  # the default first
        names = ", ".join(m.name for m in METHODS if m.script == script)
        commands.append((script, f"{names} (hftrain/recipes/{script}.py)"))
    return commands


def _add_training(sub) -> None:
    launch_help = ("Render the recipe's launcher config (into a private temporary folder) and run accelerate launch "
                   "with it; on several machines run it on each (--machine-rank K).")
    for name, what in _training_commands():
        la = sub.add_parser(name, allow_abbrev=False, help=f"Train: {what}. {launch_help}")
        _recipe_arguments(la)
        if name == "launch":
            la.add_argument("--script", default=None, help="a training script of your own instead of the recipe's "
                            "method")
        la.add_argument("--max-restarts", dest="max_restarts", type=int, default=0,
                        help="restart the workers this many times when one dies")
        la.add_argument("--machine-rank", dest="machine_rank", type=int, default=None,
                        help="this machine's rank (same as strategy.machine_rank=K); run once on each machine")
        la.add_argument("--dry-run", action="store_true", help="print the command and the launcher config only")
        la.set_defaults(fn=_launch, kind=None if name == "launch" else name, script=None)


def _add_push(sub) -> None:
    pu = sub.add_parser("push", allow_abbrev=False,
                        help="Validate a finished run's output_dir, write its model card and upload it to the Hub.")
    pu.add_argument("output_dir", help="the run's training.output_dir")
    pu.add_argument("--repo-id", dest="repo_id", help="your-name/model-name (default: the run's hub.repo_id)")
    pu.add_argument("--private", action="store_true", help="create the repository private")
    pu.add_argument("--revision", help="branch to push to, created if missing (default: main)")
    pu.add_argument("--commit-message", dest="commit_message")
    pu.add_argument("--merge-lora", dest="merge_lora", action="store_true",
                    help="LoRA runs: push output_dir/merged (model.lora.merge) instead of the adapter")
    pu.add_argument("--license", help="license id for the card's metadata, e.g. apache-2.0")
    pu.add_argument("--stage-dir", dest="stage_dir", help="where to write the upload (default: OUTPUT_DIR/hub_upload)")
    pu.add_argument("--dry-run", action="store_true",
                    help="validate and write the exact folder that would be uploaded, print its files; needs no token")
    pu.set_defaults(fn=_push)


def _add_moe(sub) -> None:
    mo = sub.add_parser("moe", allow_abbrev=False, help="Mixture-of-experts tools.")
    up = mo.add_subparsers(dest="moe_command", required=True).add_parser(
        "upcycle", allow_abbrev=False,
        help="Dense Llama/Mistral -> Mixtral, Qwen2 -> Qwen2-MoE, Qwen3 -> Qwen3-MoE: each chosen MLP becomes E "
        "copies + a router; outputs unchanged; saved as the native transformers class (loads with transformers' Auto "
        "class alone).")
    up.add_argument("--model", required=True, help="dense model folder (safetensors)")
    up.add_argument("--num-experts", dest="num_experts", type=int, required=True)
    up.add_argument("--top-k", dest="top_k", type=int, required=True)
    up.add_argument("--layers", type=int, nargs="+", default=None, help="layer indices to upcycle (default: all)")
    up.add_argument("--router-init-std", dest="router_init_std", type=float, default=None)
    up.add_argument("--seed", type=int, default=0, help="seed of the routers' random init")
    up.add_argument("--output", required=True, help="folder to write the MoE model (and the tokenizer) to")
    up.set_defaults(fn=_moe_upcycle)


# Each subcommand registers itself: its parser, its options and the function that runs it (`fn`).
COMMANDS = (_add_check, _add_prepare, _add_data, _add_config, _add_plan, _add_training, _add_push,
            add_tiny_model_command, _add_moe)
TAKES_OVERRIDES = ("check", "config", "data", "launch", "plan", "prepare", *SCRIPTS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hftrain", allow_abbrev=False, description="Fine-tune LLMs from one YAML recipe.")
    sub = p.add_subparsers(dest="command", required=True)
    for register in COMMANDS:
        register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come anywhere after the recipe, also after options: gather what argparse left over.
    ns, extra = parser.parse_known_args(argv)
    if extra and ns.command in TAKES_OVERRIDES:
        ns.overrides = list(ns.overrides or []) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    with exit_on_user_error():
        return ns.fn(ns)


if __name__ == "__main__":
    sys.exit(main())
