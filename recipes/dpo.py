"""Preference tuning (DPO, IPO, SimPO) of a causal LM from one YAML recipe with a `preference:` section.

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/dpo.py recipes/demo/dpo.yaml [key=value ...]
    python recipes/dpo.py recipes/demo/dpo.yaml training.max_steps=10

set up -> pairs -> model -> trainer (TRL's DPOTrainer on hftrain's Trainer) -> train -> save. The detail lives in
the hftrain package (hftrain/preference.py says what is built on TRL and what is written by hand, and why).
"""

import sys

from hftrain import distributed
from hftrain.artifacts import first_eval, save_final, write_recipe
from hftrain.callbacks import CurvesCallback
from hftrain.errors import exit_on_user_error
from hftrain.hub.push import check_token, push_after_training
from hftrain.launch import check_data, claim_output_dir, setup_run, write_strategy_configs
from hftrain.preference import PreferenceTrainer, dpo_config, load_policy

# What the demo is judged by: held-out reward accuracy and margin (TRL's metrics), before and after.
REPORTED = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "loss")


def held_out(trainer) -> dict:
    """TRL's metrics on the held-out pairs now (after training: the evaluation loop needs train()'s set-up)."""
    if trainer.eval_dataset is None:
        return {}
    metrics = trainer.evaluate()
    return {k: metrics[f"eval_{k}"] for k in REPORTED if f"eval_{k}" in metrics}


def main(argv: list[str]) -> None:
    # 1. Set up: every problem of the recipe (its preference: section included) at once, then the process group.
    run = setup_run(argv, method="dpo")
    recipe, strategy = run.recipe, run.strategy
    check_token(recipe.hub)  # hub.push: the token must be there before training, not after

    # 2. Pairs before the model: every row read and checked (file and row named), one step's worth present.
    tokenizer, data = check_data(recipe, run.args.world_size, seed=run.args.seed)
    claim_output_dir(recipe)
    # The policy; the reference is TRL's: the adapter disabled (LoRA), a frozen copy, or precomputed log-probs.
    model, peft_config = load_policy(recipe.model)
    write_recipe(recipe)
    if distributed.is_main_process():
        write_strategy_configs(recipe, strategy)

    # 3. Trainer: TRL's DPOTrainer (tokenising with the chat template, the losses, rewards/* metrics) over hftrain's
    #    Trainer (staged checkpoints, guards), the loss the exact mean over the pairs of the global batch.
    trainer = PreferenceTrainer(
        model=model,
        args=dpo_config(run.args, recipe),
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[CurvesCallback()],
        preference=recipe.preference,
        strategy=strategy.name,  # the engine built is checked against it before the first step
        compression=recipe.compression,  # gradient compression on the data-parallel reduction (+ comm/* metrics)
        max_bad_steps=recipe.training["max_bad_steps"],  # non-finite steps skipped before the run stops
        resume_weights_only=recipe.training["resume_weights_only"],  # fresh optimizer and schedule at resume
    )

    # 4. Train, with the held-out rewards before (eval_on_start, set when there are held-out pairs) and after.
    train_result = trainer.train(resume_from_checkpoint=recipe.resume_from_checkpoint or None)
    before = {k[5:]: v for k, v in first_eval(trainer.state.log_history, tuple(f"eval_{k}" for k in REPORTED)).items()}
    after = held_out(trainer)
    metrics = {**train_result.metrics, **{f"final_eval_{k}": v for k, v in after.items()},
               **{f"initial_eval_{k}": v for k, v in before.items()}}
    trainer.log_metrics("train", train_result.metrics)

    # 5. Save: consolidated safetensors + tokenizer + trainer_state.json + run_info.json in output_dir.
    save_final(trainer, recipe, strategy, tokenizer, metrics)
    for key in REPORTED:
        if key in after and key in before:
            distributed.print0(f"hftrain: held-out {key}: before {before[key]:.4f} -> after {after[key]:.4f}")
    distributed.print0(f"hftrain: saved to {recipe.output_dir}")
    del trainer, model
    distributed.shutdown()
    push_after_training(recipe)  # hub.push: validate output_dir, then upload it (main process, no collective)


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])
