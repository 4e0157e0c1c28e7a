"""One rank of test_stream's two-process test: the training dataloader the Trainer builds for a streaming recipe
(accelerate's, with its sharding of the stream), its first batches' row texts written to OUT/rank<r>.json.

    accelerate launch --num_processes 2 tests/stream_worker.py MODEL_DIR DATA.jsonl OUT_DIR
"""

import json
import os
import sys


def main(model_dir: str, path: str, out: str) -> None:
    from hftrain.launch import check_data, setup_run
    from hftrain.modeling import load_model
    from hftrain.methods.sft import SFTTrainer

    run = setup_run([], raw={
        "model": {"name_or_path": model_dir, "dtype": "float32"},
        "data": {"sources": [{"path": path}], "max_length": 32, "streaming": True, "shuffle_buffer": 16},
        "training": {"output_dir": os.path.join(out, "run"), "max_steps": 3, "per_device_train_batch_size": 4,
                     "report_to": "none", "disable_tqdm": True}})
    tokenizer, data = check_data(run.recipe, run.args.world_size, seed=run.args.seed)
    trainer = SFTTrainer(
        model=load_model(run.recipe.model), args=run.args, train_dataset=data.train, processing_class=tokenizer,
        data_collator=data.collator)
    texts = []
    for batch, _ in zip(trainer.get_train_dataloader(), range(5)):
        texts += [tokenizer.decode([t for t in row if t != tokenizer.pad_token_id])
                  for row in batch["input_ids"].tolist()]
    with open(os.path.join(out, f"rank{run.args.process_index}.json"), "w") as fh:
        json.dump({"texts": texts, "dispatch": trainer.accelerator.dataloader_config.dispatch_batches}, fh)
    trainer.train()  # and it trains: 3 steps over the two shares


if __name__ == "__main__":
    main(*sys.argv[1:4])
