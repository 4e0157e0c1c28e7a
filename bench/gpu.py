"""hftrain on one GPU against a plain transformers Trainer and TRL's SFTTrainer with Liger, side by side in one run.

    python bench/gpu.py [--part all|throughput|loss|demo] [--steps 30] [--warmup 10] [--out FILE.json]
    python bench/gpu.py --tiny        a few seconds on a CPU with a tiny model (tests/test_bench.py runs it)

Sized for the device tool's budget (under 5 minutes on one H100 or H200; nothing here is downloaded):

1. throughput: a TinyLlama-1.1B-shaped Llama (SHAPE), random weights saved once, `--batch` rows of `--seq` random
   tokens per step (the same rows for every side), bf16 autocast on fp32 weights, sdpa, torch's AdamW. Sides: a plain
   transformers Trainer; hftrain as a recipe that says nothing about kernels (Liger's layers where installed, the
   chunked loss); hftrain with them off (model.kernels: none, training.loss_impl: logits); hftrain with
   training.loss_impl: fused (Liger's fused linear cross-entropy, asked for by that key; where liger-kernel is
   installed); hftrain with training.torch_compile; TRL's SFTTrainer with use_liger_kernel (where TRL and liger-kernel
   are installed). Per
   side: the median step after `--warmup` steps (wall time, the device synchronised around each step), tokens/s,
   MFU = tokens/s x (6 N + 6 L d T) / the GPU's dense bf16 peak (PEAK_FLOPS; n/a for another GPU), peak memory.
2. loss: one decoder layer (hidden 2048) and 8192 target tokens at vocabularies 131072 and 262144, in this one
   process: a step of the loss (forward and backward) through hftrain's logits path, its chunked path and (on CUDA
   with liger-kernel) training.loss_impl: fused, Liger's kernel: peak memory, tokens/s, the ratios to logits and each
   loss's relative difference from the logits path's (fused must be exact and faster before it is ever a default).
3. demo: `hftrain sft recipes/demo/sft.yaml` on the GPU, as a user runs it: wall time and its held-out exact match.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hftrain.config import HFTrainingArguments  # noqa: E402
from hftrain.launch.setup import training_arguments  # noqa: E402
from hftrain.losses import fused_ce  # noqa: E402
from hftrain.methods import load_recipe  # noqa: E402
from hftrain.methods.sft import SFTTrainer  # noqa: E402
from hftrain.modeling import load_model  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16, SXM


class StepTimer(TrainerCallback):
    """Each optimizer step's wall time (on_step_begin -> on_step_end), the device synchronised around it."""

    def __init__(self):
        self.times: list[float] = []
        self._t = 0.0

    def _sync(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_step_begin(self, *args, **kwargs):
        self._sync()
        self._t = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
        self._sync()
        self.times.append(time.perf_counter() - self._t)


def random_rows(n: int, seq: int, vocab: int, seed: int = 0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * seq for _ in ids]})


def save_model(shape: dict, folder: str) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**shape, tie_word_embeddings=False)).save_pretrained(folder)
    return folder


def matmul_params(shape: dict) -> float:
    """N of 6N: the weights every token is multiplied by (attention, MLP, the output head; not the embedding)."""
    d, kv = shape["hidden_size"], shape["num_key_value_heads"] / shape["num_attention_heads"]
    attention = 2 * d * d + 2 * d * d * kv  # q and o; k and v, grouped
    return shape["num_hidden_layers"] * (attention + 3 * d * shape["intermediate_size"]) + shape["vocab_size"] * d


def mfu(tokens_per_s: float, shape: dict, seq: int) -> float | None:
    """Model FLOPs utilisation: 6N per token plus causal attention's 6 L d T, over the GPU's dense bf16 peak."""
    if not torch.cuda.is_available():
        return None
    peak = next((v for k, v in PEAK_FLOPS.items() if k in torch.cuda.get_device_name()), None)
    flops = 6 * matmul_params(shape) + 6 * shape["num_hidden_layers"] * shape["hidden_size"] * seq
    return None if peak is None else tokens_per_s * flops / peak


def timed(make_trainer, steps: int, warmup: int, tokens_per_step: int) -> dict:
    """Train through the trainer make_trainer(timer) builds; its steady-state figures."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    timer = StepTimer()
    trainer = make_trainer(timer)
    trainer.train()
    step = statistics.median(timer.times[warmup:] if len(timer.times) > warmup else timer.times)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    del trainer
    return {"step_s": step, "tokens_per_s": tokens_per_step / step, "peak_bytes": peak, "steps": len(timer.times)}


def plain_side(model_dir, rows, ns, out):
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

    def make(timer):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        args = TrainingArguments(output_dir=out, max_steps=ns.steps, per_device_train_batch_size=ns.batch,
                                 bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
                                 optim="adamw_torch", learning_rate=1e-5, lr_scheduler_type="constant",
                                 save_strategy="no", report_to="none", logging_steps=10**6, disable_tqdm=True)
        return Trainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator,
                       callbacks=[timer])
    return make


def hftrain_side(model_dir, rows, ns, out, *overrides):
    from transformers import default_data_collator

    recipe = load_recipe(None, [
        f"model.name_or_path={model_dir}", "model.attn_implementation=sdpa", "model.dtype=float32",
        "data.sources.0.path=unused.jsonl", f"training.output_dir={out}", f"training.max_steps={ns.steps}",
        f"training.per_device_train_batch_size={ns.batch}", f"training.bf16={torch.cuda.is_available()}",
        "training.optim=adamw_torch", "training.learning_rate=1e-5", "training.lr_scheduler_type=constant",
        "training.save_strategy=no", "training.report_to=none", "training.logging_steps=1000000",
        "training.disable_tqdm=true", *overrides], raw={})

    def make(timer):
        return SFTTrainer(model=load_model(recipe.model), args=training_arguments(recipe), train_dataset=rows,
                          data_collator=default_data_collator, callbacks=[timer])
    return make


def fused_runs() -> bool:
    """Whether training.loss_impl: fused runs here (CUDA, liger-kernel installed): it is measured only where asked."""
    return torch.cuda.is_available() and fused_ce.machine_problem("cuda") is None


def trl_liger_side(model_dir, rows, ns, out):
    from transformers import AutoModelForCausalLM, default_data_collator
    from trl import SFTConfig
    from trl import SFTTrainer as TRLSFTTrainer

    def make(timer):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        args = SFTConfig(output_dir=out, max_steps=ns.steps, per_device_train_batch_size=ns.batch, bf16=True,
                         optim="adamw_torch", learning_rate=1e-5, lr_scheduler_type="constant", save_strategy="no",
                         report_to="none", logging_steps=10**6, disable_tqdm=True, use_liger_kernel=True,
                         max_length=ns.seq, dataset_kwargs={"skip_prepare_dataset": True})
        return TRLSFTTrainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator,
                             callbacks=[timer])
    return make


def part_throughput(ns, tmp: str, shape: dict) -> dict:
    model_dir = save_model(shape, os.path.join(tmp, "model"))
    rows = random_rows(ns.steps * ns.batch, ns.seq, shape["vocab_size"])
    out = os.path.join(tmp, "out")
    liger = importlib.util.find_spec("liger_kernel") is not None
    sides = {"plain Trainer": plain_side(model_dir, rows, ns, out),
             "hftrain (defaults)": hftrain_side(model_dir, rows, ns, out),
             "hftrain kernels off": hftrain_side(model_dir, rows, ns, out, "model.kernels=none",
                                                 "training.loss_impl=logits")}
    if fused_runs():
        sides["hftrain fused loss"] = hftrain_side(model_dir, rows, ns, out, "training.loss_impl=fused")
    if not ns.tiny:  # inductor's compile takes minutes on a CPU
        sides["hftrain torch_compile"] = hftrain_side(model_dir, rows, ns, out, "training.torch_compile=true")
    if liger and torch.cuda.is_available() and importlib.util.find_spec("trl") is not None:
        sides["TRL SFTTrainer + Liger"] = trl_liger_side(model_dir, rows, ns, out)
    res = {}
    for name, make in sides.items():
        res[name] = timed(make, ns.steps, ns.warmup, ns.batch * ns.seq)
        res[name]["mfu"] = mfu(res[name]["tokens_per_s"], shape, ns.seq)
    base = res["plain Trainer"]["tokens_per_s"]
    print(f"throughput: {ns.batch} x {ns.seq} tokens per step, median step after {ns.warmup} warm-up steps"
          f"{'' if liger else ' (liger-kernel not installed)'}")
    print("| side | step | tokens/s | vs plain | MFU | peak memory |\n|---|---|---|---|---|---|")
    for name, r in res.items():
        peak = f"{r['peak_bytes'] / 2**30:.2f} GiB" if r["peak_bytes"] else "-"
        util = f"{r['mfu']:.1%}" if r["mfu"] else "n/a"
        print(f"| {name} | {r['step_s'] * 1e3:.1f} ms | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.3f}x | "
              f"{util} | {peak} |")
    return res


def loss_step(vocab: int, tokens: int, impl: str, hidden: int, tmp: str) -> dict:
    """One step of the loss through SFTTrainer.compute_loss: a 1-layer Llama's forward, the loss, its backward."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 512),
                         vocab_size=vocab, max_position_embeddings=tokens, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(device).train()
    args = HFTrainingArguments(output_dir=tmp, report_to="none", loss_impl=impl, use_cpu=device == "cpu")
    trainer = SFTTrainer(model=model, args=args)
    ids = torch.randint(0, vocab, (1, tokens), device=device)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    times = []
    for i in range(4):  # the first is warm-up
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    del trainer, model
    return {"step_s": statistics.median(times[1:]), "tokens_per_s": tokens / statistics.median(times[1:]),
            "peak_bytes": peak, "loss": float(loss.detach())}


def part_loss(ns, tmp: str) -> dict:
    vocabs, tokens, hidden = ((1024, 2048), 256, 64) if ns.tiny else ((131072, 262144), 8192, 2048)
    impls = ("logits", "chunked", "fused") if fused_runs() else ("logits", "chunked")
    res = {}
    print(f"loss: one decoder layer, hidden {hidden}, {tokens} target tokens; peak memory of the step, tokens/s; "
          "vs logits: memory, speed, the loss's relative difference")
    print(f"| vocabulary | {' | '.join(impls)} |\n|---|{'---|' * len(impls)}")
    for vocab in vocabs:
        r = {impl: loss_step(vocab, tokens, impl, hidden, tmp) for impl in impls}
        res[vocab] = r
        base = r["logits"]
        cells = [f"{(x['peak_bytes'] or 0) / 2**30:.2f} GiB, {x['tokens_per_s']:.0f}" for x in r.values()]
        for i, x in enumerate(list(r.values())[1:], start=1):
            mem = f"{x['peak_bytes'] / base['peak_bytes']:.2f}x" if base["peak_bytes"] else "n/a"
            cells[i] += (f" ({mem}, {x['tokens_per_s'] / base['tokens_per_s']:.2f}x, "
                         f"{abs(x['loss'] - base['loss']) / abs(base['loss']):.1e})")
        print(f"| {vocab} | {' | '.join(cells)} |")
    return res


def part_demo(ns, tmp: str) -> dict:
    if not torch.cuda.is_available():
        print("demo: skipped (no GPU: the demo's CPU run is tests/test_e2e.py's)")
        return {}
    base, out = os.path.join(tmp, "demo-base"), os.path.join(tmp, "demo")
    subprocess.run([sys.executable, "-m", "hftrain.cli", "tiny-model", "--data", "data/demo/train.jsonl", "--output",
                    base], cwd=REPO, check=True, capture_output=True)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "hftrain.cli", "sft", "recipes/demo/sft.yaml",
                        f"model.name_or_path={base}", f"training.output_dir={out}"], cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    wall = time.perf_counter() - t
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("hftrain: exact_match")]
    print(f"demo: exit {r.returncode} in {wall:.0f} s; {lines[-1] if lines else r.stderr[-500:]}")
    return {"exit": r.returncode, "wall_s": wall, "exact_match": lines[-1] if lines else None}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--part", choices=("throughput", "loss", "demo", "all"), default="all")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--tiny", action="store_true", help="a tiny model and few steps: a smoke run on a CPU")
    ap.add_argument("--out", help="write every figure to this JSON file")
    ns = ap.parse_args(argv)
    if ns.tiny:
        ns.steps, ns.warmup, ns.batch, ns.seq = min(ns.steps, 4), min(ns.warmup, 1), 2, 64
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no GPU)"
    print(f"bench/gpu.py on {device}; torch {torch.__version__}")
    tmp = tempfile.mkdtemp(prefix="hftrain-gpu-bench-")
    report: dict = {"device": device}
    if ns.part in ("throughput", "all"):
        report["throughput"] = part_throughput(ns, tmp, TINY_SHAPE if ns.tiny else SHAPE)
    if ns.part in ("loss", "all"):
        report["loss"] = part_loss(ns, tmp)
    if ns.part in ("demo", "all"):
        report["demo"] = part_demo(ns, tmp)
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump(report, fh, indent=1, default=str)
    return report


if __name__ == "__main__":
    main()
