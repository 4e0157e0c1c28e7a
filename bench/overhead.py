"""hftrain's cost against a plain transformers Trainer, and what packing buys.

    python bench/overhead.py [--steps 80] [--repeats 6]

1. Step time: the same tiny model, the same tokenised batches, trained for the same steps once through hftrain's
   pieces (recipe -> TrainingArguments, data collator, callbacks) and once through a plain Trainer with
   transformers' defaults, alternated A/B `--repeats` times in this one process. Prints median step times and the
   ratio hftrain / plain (goal <= 1.03).
2. Packing: a length-skewed text set (most examples short, a few long) trained padded and packed through hftrain.
   Prints the share of non-pad tokens in the batches and the real-token throughput ratio packed / padded
   (goals >= 99% and >= 1.8x).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch
from transformers import DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hftrain.callbacks import CurvesCallback  # noqa: E402
from hftrain.data import build_datasets  # noqa: E402
from hftrain.modeling import load_model, load_tokenizer  # noqa: E402
from hftrain.recipe import load_recipe  # noqa: E402
from hftrain.tiny import build_tiny_model, texts_of_jsonl  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "data", "demo", "train.jsonl")


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step, and the real (non-pad, non-separator) tokens it consumed."""

    def __init__(self):
        self.times: list[float] = []
        self._t = 0.0

    def on_step_begin(self, args, state, control, **kw):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self._t)


def median_after_warmup(times: list[float], warmup: int = 5) -> float:
    return statistics.median(times[warmup:] if len(times) > warmup + 2 else times)


def recipe_for(model_dir: str, data: str, out: str, steps: int, bs: int, packing: bool, max_length: int,
               extra: tuple[str, ...] = ()):
    return load_recipe(None, [
        f"model.name_or_path={model_dir}", f"data.sources.0.path={data}", f"data.max_length={max_length}",
        f"data.packing={str(packing).lower()}", f"training.output_dir={out}", f"training.max_steps={steps}",
        f"training.per_device_train_batch_size={bs}", "training.save_strategy=no", "training.report_to=none",
        "training.disable_tqdm=true", "training.logging_steps=1000", "training.seed=0",
    ] + list(extra), raw={})


def hftrain_steps(recipe, tokenizer, model_dir, count: bool = False) -> tuple[list[float], int, int]:
    """Train through hftrain's pieces; (step times, real tokens, tokens in batches incl. padding)."""
    args = recipe.training_arguments()
    model = load_model(recipe.model, packing=recipe.data.packing)
    data = build_datasets(recipe.data, tokenizer, seed=0)
    timer = StepTimer()
    counted = {"real": 0, "slots": 0}

    def counting(features):
        batch = data.collator(features)
        counted["real"] += sum(len(f["input_ids"]) for f in features)
        counted["slots"] += batch["input_ids"].numel()
        return batch

    trainer = Trainer(model=model, args=args, train_dataset=data.train, processing_class=tokenizer,
                      data_collator=counting if count else data.collator, callbacks=[CurvesCallback(), timer])
    trainer.train()
    return timer.times, counted["real"], counted["slots"]


def plain_steps(model_dir, train_dataset, tokenizer, out, steps, bs) -> list[float]:
    """The same data through a plain Trainer script: transformers' defaults, its own padding collator."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=bs, save_strategy="no",
                             report_to="none", disable_tqdm=True, logging_steps=1000, seed=0, use_cpu=True)
    timer = StepTimer()
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, processing_class=tokenizer,
                      data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True), callbacks=[timer])
    trainer.train()
    return timer.times


def skewed_text_file(path: str, n: int = 2000, seed: int = 0) -> str:
    """Lengths from a heavy-tailed distribution: most examples a few words, some hundreds."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(n):
            words = max(2, min(200, int(rng.lognormvariate(2.3, 0.9))))
            fh.write(json.dumps({"text": " ".join(rng.choice("abcdefghij") for _ in range(words))}) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=16)
    ns = ap.parse_args()
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="hftrain-bench-")
    model_dir = build_tiny_model(os.path.join(tmp, "base"), texts_of_jsonl([DEMO]))
    out = os.path.join(tmp, "out")

    # 1. Step-time overhead, alternated. hftrain counts input tokens by default (for tokens/s): a gather and a
    #    host sync per step, measured separately.
    rec = recipe_for(model_dir, DEMO, out, ns.steps, ns.batch_size, packing=False, max_length=64)
    rec_nocount = recipe_for(model_dir, DEMO, out, ns.steps, ns.batch_size, packing=False, max_length=64,
                             extra=("training.include_num_input_tokens_seen=no",))
    tokenizer = load_tokenizer(rec.model)
    shared = build_datasets(rec.data, tokenizer, seed=0).train
    sides = {
        "hftrain": lambda: hftrain_steps(rec, tokenizer, model_dir)[0],
        "hftrain, token count off": lambda: hftrain_steps(rec_nocount, tokenizer, model_dir)[0],
        "plain": lambda: plain_steps(model_dir, shared, tokenizer, out, ns.steps, ns.batch_size),
    }
    medians: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(ns.repeats):  # rotate the order, so no side always runs first
        names = list(sides)[i % 3:] + list(sides)[: i % 3]
        for name in names:
            medians[name].append(median_after_warmup(sides[name]()))
    t = {k: statistics.median(v) for k, v in medians.items()}
    print(f"step time: plain Trainer {t['plain'] * 1e3:.2f} ms ({ns.repeats} rotated runs of {ns.steps} steps, "
          f"batch {ns.batch_size})")
    for name in ("hftrain", "hftrain, token count off"):
        print(f"step time: {name} {t[name] * 1e3:.2f} ms, ratio {t[name] / t['plain']:.3f} (goal <= 1.03)")

    # 2. Packing on a length-skewed set.
    skewed = skewed_text_file(os.path.join(tmp, "skewed.jsonl"))
    res = {}
    for packing in (False, True):
        r = recipe_for(model_dir, skewed, out, ns.steps, ns.batch_size, packing=packing, max_length=256)
        tputs = []
        for _ in range(ns.repeats):
            times, real, slots = hftrain_steps(r, tokenizer, model_dir, count=True)
            tputs.append(real / sum(times))
        res[packing] = (real / slots, statistics.median(tputs))
    print(f"packing: non-pad share padded {res[False][0]:.1%}, packed {res[True][0]:.1%} (goal >= 99%)")
    print(f"packing: real tokens/s padded {res[False][1]:.0f}, packed {res[True][1]:.0f}, "
          f"ratio {res[True][1] / res[False][1]:.2f}x (goal >= 1.8x)")


if __name__ == "__main__":
    main()
