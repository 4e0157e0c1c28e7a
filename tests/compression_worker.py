"""Test driver (2 ranks under accelerate launch): train with a compression method and record, per optimizer step,
whether every rank holds the same weights and how many gradient bytes the collectives really carried.

    python -m accelerate.commands.launch --config_file accelerate_configs/ddp.yaml tests/compression_worker.py \
        RECIPE OUT.json [key=value ...]

or as one variant of a matrix launch (tests/matrix_worker.py: `main(argv)`, several methods in one launch).

The bytes are counted by wrapping torch.distributed's all_reduce / all_gather_single, so the test compares
the callback's logged comm/bytes_sent with what was actually handed to the collectives (not with its own maths).
"""

import hashlib
import json
import sys

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hftrain import distributed
from hftrain.artifacts import describe
from hftrain.data import build_datasets
from hftrain.launch import setup_run
from hftrain.modeling import load_model, load_tokenizer
from hftrain.methods.sft import SFTTrainer

COUNTED = {"bytes": 0}


def counting(fn, name):
    def wrapper(*args, **kwargs):
        # the rank's own contribution
        t = (args[1] if len(args) > 1 else kwargs.get("input_tensor")) if name == "all_gather_single" else (
            args[0] if args else kwargs.get("tensor"))
        # gradient payloads, not the Trainer's token counts
        if t is not None and t.numel() >= 64 and t.dtype != torch.int64:
            COUNTED["bytes"] += t.numel() * t.element_size()
        return fn(*args, **kwargs)

    return wrapper


dist.all_reduce = counting(dist.all_reduce, "all_reduce")
dist.all_gather_single = counting(dist.all_gather_single, "all_gather_single")


class EveryStep(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        h = hashlib.sha256()
        for _, p in sorted(model.state_dict().items()):
            p = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 shards (a collective: all ranks call it)
            h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        digests = distributed.all_gather_object(h.hexdigest())
        self.steps.append({"ranks_equal": len(set(digests)) == 1, "counted_bytes": COUNTED["bytes"]})
        COUNTED["bytes"] = 0


def main(argv: list[str]) -> None:
    recipe_path, out, *overrides = argv
    run = setup_run([recipe_path, *overrides])
    recipe, strategy, args = run.recipe, run.strategy, run.args
    tokenizer = load_tokenizer(recipe.model, recipe.data.chat_template)
    model = load_model(recipe.model)
    data = build_datasets(recipe.data, tokenizer, seed=args.seed)
    every = EveryStep()
    trainer = SFTTrainer(model=model, args=args, train_dataset=data.train, processing_class=tokenizer,
                         data_collator=data.collator, callbacks=[every])
    COUNTED["bytes"] = 0
    trainer.train()
    if distributed.is_main_process():
        with open(out, "w") as fh:
            json.dump({"steps": every.steps, "log_history": trainer.state.log_history,
                       "world_size": args.world_size, **describe(trainer, strategy)}, fh)
    del trainer, model
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
