"""One run, in one order, for every training method: a recipe script (hftrain/recipes/) calls `run(script, argv)`, and
the recipe's method (hftrain/methods/: its arguments, model, trainer and held-out metrics) fills in what differs:

    validate + set up (arguments built once, resume resolved once) -> Hub token -> data -> claim output_dir -> model
    -> trainer -> metrics before -> train -> metrics after -> save -> report (trackers too) -> shut down
    -> benchmark (eval.harness) -> push

A stop request (SIGUSR1, e.g. SLURM's warning before a time limit) ends the run after train() with its checkpoint
saved (stop_request/mixin.py): no metrics after, no final save, no push; the restarted run resumes.
"""

from __future__ import annotations

import math

from . import distributed, sequence_parallel
from .artifacts import first_eval, save_final, write_recipe
from .callbacks import CurvesCallback
from .data.templates import stop_at_end_of_turn
from .harness import evaluate_after_training
from .hub.push import check_token, push_after_training
from .kernels import kernels_line
from .launch import Run, check_data, claim_output_dir, setup_run, write_strategy_configs
from .methods import method_of
from .moe.balance import balancing_line


def read_data(run: Run):
    """(tokenizer, datasets): the method's data phase, every row read and checked, errors naming the file and row
    (launch.check_data). One step takes a micro-batch per data-parallel rank (a group of sequence-parallel ranks
    shares one)."""
    return check_data(run.recipe, run.args.world_size // sequence_parallel.size(run.args), seed=run.args.seed)


def run(script: str, argv: list[str]) -> dict:
    """Run the recipe and overrides in `argv` with recipe script `script` (sft, dpo, grpo: the script must be the one
    the recipe's method needs), by the recipe's method (methods.method_of); returns the metrics saved in
    run_info.json."""
    # 1. Every problem of the recipe in this environment at once, then the process, its arguments and resume.
    run = setup_run(argv, script)
    recipe, args = run.recipe, run.args
    method = method_of(recipe)
    check_token(recipe.hub)  # hub.push: the token must be there before training, not after

    # 2. Data before the model: every row read and checked (the main process first; the others reuse its cache),
    #    so a bad row stops the run before any weight is loaded. Then output_dir is locked for this run.
    tokenizer, data = read_data(run)
    claim_output_dir(recipe)
    model = method.model(run)
    distributed.print0("hftrain: " + kernels_line(recipe.model.kernels, model.config.model_type,
                                                  quantized=recipe.model.quantization is not None))
    balancing = balancing_line(model, recipe.moe)  # on or off, one rule for every method (moe/balance.py)
    if balancing:
        distributed.print0("hftrain: " + balancing)
    if method.policy(recipe).head.generates:  # generate() stops where turns end
        stop_at_end_of_turn(model, tokenizer, recipe.data.chat_template_kwargs)
    write_recipe(recipe)
    if distributed.is_main_process():
        write_strategy_configs(recipe, run.strategy)

    # 3. Train, with the held-out metrics before (eval_on_start) and after.
    trainer = method.trainer(run, model, tokenizer, data, [CurvesCallback()])
    before = method.metrics(run, trainer, data, before=True)
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if trainer.stopped_at is not None:  # a stop request (SIGUSR1): checkpoint-N is saved; no final save, exit 0
        del trainer, model
        distributed.shutdown()
        return {"stopped_at": result.global_step}
    before.update(first_eval(trainer.state.log_history, method.reported))
    after = method.metrics(run, trainer, data, before=False)
    if data.eval is not None:
        evaluated = trainer.evaluate()
        after.update({k: evaluated[k] for k in method.reported if k in evaluated})
    metrics = {**result.metrics, **{f"final_{k}": v for k, v in after.items()},
               **{f"initial_{k}": v for k, v in before.items()}}
    trainer.log_metrics("train", result.metrics)

    # 4. Save: consolidated safetensors + tokenizer + trainer_state.json + run_info.json in output_dir; then push.
    save_final(trainer, recipe, run.strategy, tokenizer, metrics, method.card(recipe))
    trainer.report_figures(metrics)  # to the tracker run hftrain owns (trackers/), which then ends
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key, math.nan), after.get(key, math.nan)
        distributed.print0(f"hftrain: {key}: before {b:.4f} -> after {a:.4f}")
    distributed.print0(f"hftrain: saved to {recipe.output_dir}")
    del trainer, model
    distributed.shutdown()
    evaluate_after_training(recipe)  # eval.harness: main process, the saved folder; a missed gate ends the run here
    push_after_training(recipe)  # hub.push: validate output_dir, then upload it (main process, no collective)
    return metrics
