"""Supervised fine-tuning of a causal LM from one YAML recipe.

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/sft.py recipes/demo/sft.yaml [key=value ...]
    python recipes/sft.py recipes/demo/sft.yaml training.max_steps=10

parse -> model/tokenizer -> data -> trainer -> train -> save (-> Hub push). The detail lives in the hftrain package.
"""

import math
import sys

from transformers import set_seed

from hftrain import distributed, engine, moe
from hftrain.callbacks import CurvesCallback
from hftrain.data import build_datasets
from hftrain.errors import exit_on_user_error
from hftrain.evaluate import exact_match
from hftrain.hub import check_token, push_after_training
from hftrain.modeling import load_model, load_tokenizer
from hftrain.recipe import load_from_argv
from hftrain.run import check_batch, check_world_size, first_eval, save_final, write_recipe, write_strategy_configs
from hftrain.trainer import HFTrainer


def exact_match_now(trainer, data, recipe, sharded: bool) -> dict:
    """Exact-match accuracy of greedy answers on held-out prompts (generation with the unwrapped model)."""
    if not recipe.eval.exact_match:
        return {}
    return {"exact_match": exact_match(trainer.model, trainer.processing_class, data.eval_examples,
                                       recipe.eval.max_new_tokens, lockstep=sharded)}


def main(argv: list[str]) -> None:
    # 1. Parse: defaults < YAML < command line, every problem reported at once; then the launcher's strategy
    #    with the recipe's options applied (a disagreement stops here, before any model is loaded).
    recipe = load_from_argv(argv)
    check_token(recipe.hub)  # hub.push: the token must be there before training, not after
    strategy = engine.resolve_strategy(recipe)
    args = recipe.training_arguments(**engine.training_arguments_kwargs(strategy, recipe.compression))  # starts torch.distributed
    engine.after_training_arguments(strategy)
    check_world_size(args)
    set_seed(args.seed)

    # 2. Model and tokenizer (same seed on every rank, so any random init agrees).
    tokenizer = load_tokenizer(recipe.model, recipe.data.chat_template)
    model = load_model(recipe.model, packing=recipe.data.packing, moe=recipe.moe)

    # 3. Data: tokenised once on the main process, reused from the datasets cache by the others.
    data = build_datasets(recipe.data, tokenizer, seed=args.seed, exact_match=recipe.eval.exact_match)
    check_batch(args, len(data.train))
    distributed.print0(f"hftrain: {len(data.train)} training examples"
                       + (f", {len(data.eval)} held out" if data.eval is not None else ""))
    write_recipe(recipe)
    write_strategy_configs(recipe, strategy)

    # 4. Trainer: transformers' Trainer with hftrain's exact loss normalisation (hftrain/losses.py).
    trainer = HFTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=tokenizer,
        data_collator=data.collator,
        callbacks=[CurvesCallback()],
        loss_averaging=recipe.training["loss_averaging"],
        compression=recipe.compression,  # gradient compression on the data-parallel reduction (+ comm/* metrics)
    )
    moe.attach(trainer, recipe.moe)  # MoE aux / z losses, router health; ZeRO-3 leaf modules for any MoE block

    # 5. Train. The eval loss before training comes from eval_on_start (see Recipe.training_arguments); greedy
    #    answers before training need the whole model on each rank (not the case under ZeRO-3's zero.Init).
    sharded = strategy.name in engine.SHARDED
    before = {} if strategy.name in ("zero3", "zero3_offload", "zero_infinity") else exact_match_now(
        trainer, data, recipe, sharded=False)
    train_result = trainer.train(resume_from_checkpoint=recipe.resume_from_checkpoint or None)
    before.update(first_eval(trainer.state.log_history))
    after = {**exact_match_now(trainer, data, recipe, sharded),
             **({"eval_loss": trainer.evaluate()["eval_loss"]} if data.eval is not None else {})}
    metrics = {**train_result.metrics, **{f"final_{k}": v for k, v in after.items()},
               **{f"initial_{k}": v for k, v in before.items()}}
    trainer.log_metrics("train", train_result.metrics)

    # 6. Save: consolidated safetensors + tokenizer + trainer_state.json + run_info.json in output_dir.
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
