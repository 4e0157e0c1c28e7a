"""Supervised fine-tuning of a causal LM from one YAML recipe.

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/sft.py recipes/demo/sft.yaml [key=value ...]
    python recipes/sft.py recipes/demo/sft.yaml training.max_steps=10

set up -> data -> model -> trainer -> train -> save (-> Hub push). The detail lives in the hftrain package.
"""

import math
import sys

from hftrain import distributed, moe
from hftrain.artifacts import first_eval, save_final, write_recipe
from hftrain.callbacks import CurvesCallback
from hftrain.constants import SHARDED, ZERO3
from hftrain.data.templates import stop_at_end_of_turn
from hftrain.errors import exit_on_user_error
from hftrain.evaluate import exact_match
from hftrain.hub.push import check_token, push_after_training
from hftrain.launch import check_data, claim_output_dir, setup_run, write_strategy_configs
from hftrain.modeling import load_model
from hftrain.trainer import HFTrainer


def exact_match_now(trainer, data, recipe, sharded: bool) -> dict:
    """Exact-match accuracy of greedy answers on held-out prompts (generation with the unwrapped model)."""
    if not recipe.eval.exact_match:
        return {}
    return {"exact_match": exact_match(trainer.model, trainer.processing_class, data.eval_examples,
                                       recipe.eval.max_new_tokens, lockstep=sharded,
                                       chat_template_kwargs=recipe.data.chat_template_kwargs)}


def main(argv: list[str]) -> None:
    # 1. Set up: every problem of the recipe in this environment at once (defaults < YAML < command line, the
    #    launcher's strategy and world), then environment, patches, process group and TrainingArguments.
    run = setup_run(argv)
    recipe, strategy, args = run.recipe, run.strategy, run.args
    check_token(recipe.hub)  # hub.push: the token must be there before training, not after

    # 2. Data before the model: every row is read and tokenised (on the main process first, reused from the datasets
    #    cache by the others), so a bad row stops the run before any weight is loaded.
    tokenizer, data = check_data(recipe, args.world_size, seed=args.seed)
    claim_output_dir(recipe)  # every check passed: lock output_dir for this run (a second run into it is refused)
    model = load_model(recipe.model, packing=recipe.data.packing, moe=recipe.moe)
    stop_at_end_of_turn(model, tokenizer, recipe.data.chat_template_kwargs)  # generate() stops where turns end
    write_recipe(recipe)
    if distributed.is_main_process():
        write_strategy_configs(recipe, strategy)

    # 3. Trainer: transformers' Trainer with hftrain's exact loss normalisation (hftrain/losses.py).
    trainer = HFTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=tokenizer,
        data_collator=data.collator,
        callbacks=[CurvesCallback()],
        loss_averaging=recipe.training["loss_averaging"],
        resume_weights_only=recipe.training["resume_weights_only"],  # fresh optimizer and schedule at resume
        loss_impl=recipe.training["loss_impl"],  # chunked CE from the hidden states, without the full logits
        compression=recipe.compression,  # gradient compression on the data-parallel reduction (+ comm/* metrics)
        strategy=strategy.name,  # the engine built is checked against it before the first step
        max_bad_steps=recipe.training["max_bad_steps"],  # non-finite steps skipped before the run stops
    )
    moe.attach(trainer, recipe.moe)  # MoE aux / z losses, router health; ZeRO-3 leaf modules for any MoE block

    # 4. Train. The eval loss before training comes from eval_on_start (config.training.arguments_kwargs); greedy
    #    answers before training need the whole model on each rank (not the case under ZeRO-3's zero.Init).
    before = {} if strategy.name in ZERO3 else exact_match_now(trainer, data, recipe, sharded=False)
    train_result = trainer.train(resume_from_checkpoint=recipe.resume_from_checkpoint or None)
    before.update(first_eval(trainer.state.log_history))
    after = {**exact_match_now(trainer, data, recipe, strategy.name in SHARDED),
             **({"eval_loss": trainer.evaluate()["eval_loss"]} if data.eval is not None else {})}
    metrics = {**train_result.metrics, **{f"final_{k}": v for k, v in after.items()},
               **{f"initial_{k}": v for k, v in before.items()}}
    trainer.log_metrics("train", train_result.metrics)

    # 5. Save: consolidated safetensors + tokenizer + trainer_state.json + run_info.json in output_dir.
    save_final(trainer, recipe, strategy, tokenizer, metrics)
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key, math.nan), after.get(key, math.nan)
        distributed.print0(f"hftrain: {key}: before {b:.4f} -> after {a:.4f}")
    distributed.print0(f"hftrain: saved to {recipe.output_dir}")
    del trainer, model
    distributed.shutdown()
    push_after_training(recipe)  # hub.push: validate output_dir, then upload it (main process, no collective)


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])
