"""Padded against packed batches: real (non-pad) tokens per second on CPU, through hftrain's own pieces.

    python bench/packing.py [--steps 5] [--repeats 3] [--batch-size 16] [--threads 1] [--attn sdpa,eager]
                            [--sets instruct,demo] [--no-one-row]

Two data sets, each trained padded and packed with the same tiny model (hftrain.tiny, same weights), the same
tokenised examples and the same batch size, through `SFTTrainer` built as the SFT recipe builds it:
- instruct: prompt/completion pairs with instruction-like lengths (prompts 20-300 tokens, answers 5-400, both
  lognormal; data.max_length 1024, nothing truncated);
- demo: data/demo/train.jsonl (short chat examples, 10-30 tokens).
Variants: `padded` (DataCollatorForSeq2Seq), `packed` (hftrain's packing collator, make_collator(packing=True)), and
`one row` (transformers' DataCollatorWithFlattening alone: every example of the batch in one row, what hftrain's
packing was before it packed into rows; kept to show why). Runs alternate the variants (rotated order) in this one
process; each run trains `--steps` steps and drops the first as warm-up.
Measured per run, over the steps after warm-up: real tokens (every token of every example, not the padding) over
the wall time from the end of the warm-up step to the end of the last step (batch fetch and collation included),
and over the process CPU time of the same window (less sensitive to other load on a shared machine); the non-pad
share of the batches' slots. Printed: the median over runs of each, and the packed / padded ratio of the medians.
Torch runs on `--threads` threads (default 1): on a shared machine two threads' spin-waits for each other turn
other load into CPU time, and single runs then differ by 4x; one thread keeps the per-CPU-second figure steady.
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
from transformers import DataCollatorWithFlattening, TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hftrain  # noqa: E402
from hftrain.methods import load_recipe  # noqa: E402
from hftrain.constants import IGNORE_INDEX  # noqa: E402
from hftrain.data import build_datasets, make_collator  # noqa: E402
from hftrain.launch.setup import training_arguments  # noqa: E402
from hftrain.modeling import load_model, load_tokenizer  # noqa: E402
from hftrain.tiny import build_tiny_model, texts_of_jsonl  # noqa: E402
from hftrain.methods.sft import SFTTrainer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "data", "demo", "train.jsonl")
WARMUP = 1


def instruct_file(path: str, n: int = 600, seed: int = 0) -> str:
    """prompt/completion rows; a letter and its space are one token of the tiny tokenizer, so words ~ tokens."""
    rng = random.Random(seed)

    def words(mu: float, sigma: float, lo: int, hi: int) -> str:
        k = max(lo, min(hi, int(rng.lognormvariate(mu, sigma))))
        return " ".join(rng.choice("abcdefghij") for _ in range(k))

    with open(path, "w") as fh:
        for _ in range(n):
            fh.write(json.dumps({"prompt": "reverse: " + words(4.4, 0.7, 20, 300) + "\n",
                                 "completion": words(4.1, 1.0, 5, 400)}) + "\n")
    return path


class Window(TrainerCallback):
    """Wall and process CPU clocks at the end of each optimizer step."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_step_end(self, args, state, control, **kw):
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())


def recipe_for(model_dir: str, data: str, out: str, steps: int, bs: int, packing: bool, max_length: int, attn: str):
    return load_recipe(None, [
        f"model.name_or_path={model_dir}", f"model.attn_implementation={attn}", f"data.sources.0.path={data}",
        f"data.max_length={max_length}", f"data.packing={str(packing).lower()}", f"training.output_dir={out}",
        f"training.max_steps={steps}", f"training.per_device_train_batch_size={bs}", "training.save_strategy=no",
        "training.report_to=none", "training.disable_tqdm=true", "training.logging_steps=1000", "training.seed=0",
    ], raw={})


def one_run(recipe, train, collate) -> dict[str, float]:
    """Train `recipe` on the tokenised `train` with `collate`; real tokens/s (wall, CPU) and non-pad share."""
    args = training_arguments(recipe)
    model = load_model(recipe.model, packing=recipe.data.packing)
    batches: list[tuple[int, int]] = []  # (real tokens, slots) per collated batch, in order

    def counting(features):
        batch = collate(features)
        batches.append((sum(len(f["input_ids"]) for f in features), batch["input_ids"].numel()))
        return batch

    window = Window()
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, data_collator=counting, callbacks=[window])
    trainer.train()
    steps = len(window.wall)
    real = sum(r for r, _ in batches[WARMUP:steps])  # the batches of the timed steps (a prefetched one is left out)
    slots = sum(s for _, s in batches[WARMUP:steps])
    return {"wall": real / (window.wall[-1] - window.wall[WARMUP - 1]),
            "cpu": real / (window.cpu[-1] - window.cpu[WARMUP - 1]), "share": real / slots}


def bench_set(name: str, data: str, max_length: int, ns, model_dir: str, out: str, attn: str) -> None:
    padded_recipe = recipe_for(model_dir, data, out, ns.steps, ns.batch_size, False, max_length, attn)
    packed_recipe = recipe_for(model_dir, data, out, ns.steps, ns.batch_size, True, max_length, attn)
    tokenizer = load_tokenizer(padded_recipe.model)
    train = build_datasets(padded_recipe.data, tokenizer, seed=0).train
    lengths = [len(x) for x in train["input_ids"]]
    variants = {
        "padded": (padded_recipe, make_collator(tokenizer, packing=False)),
        "packed": (packed_recipe, make_collator(tokenizer, packing=True)),
        "one row": (packed_recipe, DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX)),
    }
    if ns.no_one_row:
        del variants["one row"]
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in variants}
    start = time.perf_counter()
    for i in range(ns.repeats):  # rotate the order, so no variant always runs first
        names = list(variants)[i % len(variants):] + list(variants)[:i % len(variants)]
        for v in names:
            gc.collect()
            runs[v].append(one_run(variants[v][0], train, variants[v][1]))
    med = {v: {k: statistics.median(r[k] for r in rs) for k in ("wall", "cpu", "share")} for v, rs in runs.items()}
    print(f"{name} ({attn}; {len(lengths)} examples, tokens mean {statistics.mean(lengths):.0f}, "
          f"max {max(lengths)}; batch {ns.batch_size}; {ns.repeats} runs x {ns.steps - WARMUP} timed steps per "
          f"variant; {time.perf_counter() - start:.0f} s)")
    for v, m in med.items():
        runs_wall = ", ".join(f"{r['wall']:.0f}" for r in runs[v])
        print(f"  {v:8s} real tokens/s wall {m['wall']:6.0f} (runs {runs_wall}), per CPU-second {m['cpu']:6.0f}; "
              f"non-pad share {m['share']:.1%}")
    for v in variants:
        if v != "padded":
            print(f"  {v} / padded: wall {med[v]['wall'] / med['padded']['wall']:.2f}x, "
                  f"CPU {med[v]['cpu'] / med['padded']['cpu']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--attn", default="sdpa,eager")
    ap.add_argument("--sets", default="instruct,demo")
    ap.add_argument("--no-one-row", action="store_true", help="leave out the one-row reference variant")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    print(f"hftrain from {os.path.dirname(hftrain.__file__)}; torch threads {torch.get_num_threads()}")
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="hftrain-bench-packing-")
    model_dir = build_tiny_model(os.path.join(tmp, "base"), texts_of_jsonl([DEMO]))
    out = os.path.join(tmp, "out")
    sets = {"instruct": (instruct_file(os.path.join(tmp, "instruct.jsonl")), 1024), "demo": (DEMO, 64)}
    for attn in ns.attn.split(","):
        for name in ns.sets.split(","):
            bench_set(name, *sets[name], ns, model_dir, out, attn)


if __name__ == "__main__":
    main()
