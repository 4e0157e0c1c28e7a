"""hftrain's per-step overhead against a plain transformers Trainer, and what packing buys.

    python bench/overhead.py [--part {overhead,packing,all}] [--steps 80] [--repeats 7] [--batch-size 16]

1. Overhead (`--part overhead`): the same tiny model (same weights) on the same tokenised data, trained for the
   same steps and batch size through
   - hftrain: `hftrain.methods.sft.SFTTrainer` built as the SFT recipe builds it (the recipe's TrainingArguments, its
     data collator, CurvesCallback, loss_averaging, compression), and
   - plain: a plain `transformers.Trainer` with transformers' default TrainingArguments and
     DataCollatorForSeq2Seq,
   plus "hftrain, token count off" (hftrain with training.include_num_input_tokens_seen=no; kept because it adds
   half the runs, not double). Runs are rotated (A B C, B C A, ...) in this one process, `--repeats` runs per side.
   Measured: per optimizer step, `time.process_time()` (CPU time of the whole process, all threads) between the
   on_step_begin and on_step_end callbacks: forward, loss, backward, clipping, optimizer and scheduler step.
   Wall time (`time.perf_counter()`) is recorded the same way for reference. The first 5 steps of each run are
   warm-up and dropped; a run's figure is its median step.
   Not inside that window: fetching and collating the step's batch and SFTTrainer.get_batch_samples (hftrain's
   global target-token count), which the Trainer runs before on_step_begin, and logging after on_step_end. The
   "full iteration" line times on_step_end to the next on_step_end, which includes them.
   Output, per measure (CPU step, wall step, CPU full iteration): each side's median of its per-run medians (ms),
   then the ratio hftrain / plain = ratio of those medians, and its spread over the pairs of runs of one rotation
   (run i of hftrain / run i of plain): `pairs median [min, max], IQR [q1, q3]`. A ratio whose [min, max] straddles
   1.0 is within run-to-run noise; read the CPU lines first (less sensitive to other load on the machine).
2. Packing (`--part packing`): a length-skewed text set (most examples short, a few long) trained padded and
   packed through hftrain's recipe pieces. Prints the share of non-pad tokens in the batches and the real-token
   throughput ratio packed / padded (goals >= 99% and >= 1.8x).
"""

from __future__ import annotations

import argparse
import gc
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
import hftrain  # noqa: E402
from hftrain.callbacks import CurvesCallback  # noqa: E402
from hftrain.data import build_datasets  # noqa: E402
from hftrain.modeling import load_model, load_tokenizer  # noqa: E402
from hftrain.methods import load_recipe  # noqa: E402
from hftrain.launch.setup import training_arguments  # noqa: E402
from hftrain.tiny import build_tiny_model, texts_of_jsonl  # noqa: E402
from hftrain.methods.sft import SFTTrainer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "data", "demo", "train.jsonl")
WARMUP = 5


class StepTimer(TrainerCallback):
    """Per optimizer step, on_step_begin -> on_step_end: CPU time (`cpu`, process_time) and wall time (`times`);
    and on_step_end -> next on_step_end, CPU time (`cycle_cpu`: the whole loop iteration, batch fetch included)."""

    def __init__(self):
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.cycle_cpu: list[float] = []
        self._t = self._c = 0.0
        self._end_c: float | None = None

    def on_step_begin(self, args, state, control, **kw):
        self._c = time.process_time()
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        t, c = time.perf_counter(), time.process_time()
        self.times.append(t - self._t)
        self.cpu.append(c - self._c)
        if self._end_c is not None:
            self.cycle_cpu.append(c - self._end_c)
        self._end_c = c


def median_after_warmup(times: list[float], warmup: int = WARMUP) -> float:
    return statistics.median(times[warmup:] if len(times) > warmup + 2 else times)


def recipe_for(model_dir: str, data: str, out: str, steps: int, bs: int, packing: bool, max_length: int,
               extra: tuple[str, ...] = ()):
    return load_recipe(None, [
        f"model.name_or_path={model_dir}", f"data.sources.0.path={data}", f"data.max_length={max_length}",
        f"data.packing={str(packing).lower()}", f"training.output_dir={out}", f"training.max_steps={steps}",
        f"training.per_device_train_batch_size={bs}", "training.save_strategy=no", "training.report_to=none",
        "training.disable_tqdm=true", "training.logging_steps=1000", "training.seed=0",
    ] + list(extra), raw={})


def step_figures(timer: StepTimer) -> dict[str, float]:
    """A run's median step (after warm-up) for each measure."""
    return {"cpu": median_after_warmup(timer.cpu), "wall": median_after_warmup(timer.times),
            "cycle_cpu": median_after_warmup(timer.cycle_cpu, WARMUP - 1)}


def hftrain_run(recipe, tokenizer) -> dict[str, float]:
    """Train through hftrain.methods.sft.SFTTrainer, built as the SFT recipe builds it."""
    args = training_arguments(recipe)
    model = load_model(recipe.model, packing=recipe.data.packing)
    data = build_datasets(recipe.data, tokenizer, seed=args.seed)
    timer = StepTimer()
    trainer = SFTTrainer(model=model, args=args, train_dataset=data.train, processing_class=tokenizer,
                         data_collator=data.collator, callbacks=[CurvesCallback(), timer])
    trainer.train()
    return step_figures(timer)


def plain_run(model_dir, train_dataset, tokenizer, out, steps, bs) -> dict[str, float]:
    """The same data through a plain Trainer script: transformers' defaults, its own padding collator."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=bs, save_strategy="no",
                             report_to="none", disable_tqdm=True, logging_steps=1000, seed=0, use_cpu=True)
    timer = StepTimer()
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, processing_class=tokenizer,
                      data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True), callbacks=[timer])
    trainer.train()
    return step_figures(timer)


def packing_steps(recipe, tokenizer) -> tuple[list[float], int, int]:
    """Part 2: train through hftrain's recipe pieces; (step wall times, real tokens, tokens in batches incl.
    padding)."""
    args = training_arguments(recipe)
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
                      data_collator=counting, callbacks=[CurvesCallback(), timer])
    trainer.train()
    return timer.times, counted["real"], counted["slots"]


def skewed_text_file(path: str, n: int = 2000, seed: int = 0) -> str:
    """Lengths from a heavy-tailed distribution: most examples a few words, some hundreds."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(n):
            words = max(2, min(200, int(rng.lognormvariate(2.3, 0.9))))
            fh.write(json.dumps({"text": " ".join(rng.choice("abcdefghij") for _ in range(words))}) + "\n")
    return path


def spread(ratios: list[float]) -> str:
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return (f"pairs median {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}], "
            f"IQR [{q1:.3f}, {q3:.3f}]")


def part_overhead(ns, tmp: str, model_dir: str, out: str) -> None:
    rec = recipe_for(model_dir, DEMO, out, ns.steps, ns.batch_size, packing=False, max_length=64)
    rec_nocount = recipe_for(model_dir, DEMO, out, ns.steps, ns.batch_size, packing=False, max_length=64,
                             extra=("training.include_num_input_tokens_seen=no",))
    tokenizer = load_tokenizer(rec.model)
    shared = build_datasets(rec.data, tokenizer, seed=0).train
    sides = {
        "hftrain": lambda: hftrain_run(rec, tokenizer),
        "hftrain, token count off": lambda: hftrain_run(rec_nocount, tokenizer),
        "plain": lambda: plain_run(model_dir, shared, tokenizer, out, ns.steps, ns.batch_size),
    }
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
    start = time.perf_counter()
    for i in range(ns.repeats):  # rotate the order, so no side always runs first
        k = i % len(sides)
        for name in list(sides)[k:] + list(sides)[:k]:
            gc.collect()
            runs[name].append(sides[name]())
    print(f"overhead: {ns.repeats} rotated runs per side of {ns.steps} steps, batch {ns.batch_size}, "
          f"first {WARMUP} steps dropped; {time.perf_counter() - start:.0f} s; torch threads "
          f"{torch.get_num_threads()}")
    labels = {"cpu": "CPU step", "wall": "wall step", "cycle_cpu": "CPU full iteration"}
    for measure, label in labels.items():
        med = {k: statistics.median(r[measure] for r in v) for k, v in runs.items()}
        print(f"{label}: plain {med['plain'] * 1e3:.2f} ms, hftrain {med['hftrain'] * 1e3:.2f} ms, "
              f"token count off {med['hftrain, token count off'] * 1e3:.2f} ms")
        for name in ("hftrain", "hftrain, token count off"):
            pairs = [a[measure] / b[measure] for a, b in zip(runs[name], runs["plain"])]
            print(f"  {name} / plain {med[name] / med['plain']:.3f}; {spread(pairs)}")


def part_packing(ns, tmp: str, model_dir: str, out: str) -> None:
    skewed = skewed_text_file(os.path.join(tmp, "skewed.jsonl"))
    tokenizer = load_tokenizer(recipe_for(model_dir, skewed, out, ns.steps, ns.batch_size, packing=False,
                                          max_length=256).model)
    res = {}
    for packing in (False, True):
        r = recipe_for(model_dir, skewed, out, ns.steps, ns.batch_size, packing=packing, max_length=256)
        tputs = []
        for _ in range(ns.repeats):
            times, real, slots = packing_steps(r, tokenizer)
            tputs.append(real / sum(times))
        res[packing] = (real / slots, statistics.median(tputs))
    print(f"packing: non-pad share padded {res[False][0]:.1%}, packed {res[True][0]:.1%} (goal >= 99%)")
    print(f"packing: real tokens/s padded {res[False][1]:.0f}, packed {res[True][1]:.0f}, "
          f"ratio {res[True][1] / res[False][1]:.2f}x (goal >= 1.8x)")


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--part", choices=("overhead", "packing", "all"), default="all")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch-size", type=int, default=16)
    ns = ap.parse_args()
    print(f"hftrain from {os.path.dirname(hftrain.__file__)}")
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="hftrain-bench-")
    model_dir = build_tiny_model(os.path.join(tmp, "base"), texts_of_jsonl([DEMO]))
    out = os.path.join(tmp, "out")
    if ns.part in ("overhead", "all"):
        part_overhead(ns, tmp, model_dir, out)
    if ns.part in ("packing", "all"):
        part_packing(ns, tmp, model_dir, out)


if __name__ == "__main__":
    main()
