"""Long context: peak memory per rank against sequence length, one process against 2 ranks sharing each sequence
(strategy.sequence_parallel: 2, ZeRO-3), with and without the chunked loss and activation checkpointing; the longest
sequence that trains within a memory budget per rank; a plot.

    flock /tmp/hftrain-heavy.lock python bench/long_context.py [--lengths 1024 2048 4096 8192 16384]
        [--budget-gib 1.0] [--variants 1p 1p_chunked 1p_ckpt 1p_chunked_ckpt sp2 sp2_chunked sp2_ckpt sp2_chunked_ckpt]
        [--out bench/long_context.png]

CPU, gloo, fp32: each variant is one run (bench/long_context_worker.py) of one example per length, in increasing
order, each step's peak resident set read per rank (VmHWM, reset before the step). "step" is the peak minus the
resident set before the step: the step's activations, logits and gradients (SGD: no optimizer state); "peak" the
resident set at its highest (the model, the libraries, the engine's buffers besides). The model is a 2-layer Llama,
hidden 64, 4 heads, vocabulary 32000, so that the logits (4 bytes x vocabulary per token, and their gradient) weigh
as they do in real models against a thin stack of layers. The longest sequence within the budget is the longest
measured whose step fits, and a linear fit of the step's memory against length (sdpa's CPU kernel holds no L x L
scores) extrapolates where each variant would reach the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.support import free_port  # noqa: E402

GiB = 2**30
MODEL = {"vocab_size": 32000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 1 << 20,
         "tie_word_embeddings": False}
VARIANTS = {  # name: (ranks per sequence, loss_impl, activation checkpointing)
    "1p": (1, "logits", False), "1p_chunked": (1, "chunked", False), "1p_ckpt": (1, "logits", True),
    "1p_chunked_ckpt": (1, "chunked", True),
    "sp2": (2, "logits", False), "sp2_chunked": (2, "chunked", False), "sp2_ckpt": (2, "logits", True),
    "sp2_chunked_ckpt": (2, "chunked", True),
}


def build_model(folder: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hftrain.tiny import train_tokenizer

    tokenizer = train_tokenizer(["long context " * 50], vocab_size=300)  # only its pad id is used
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(pad_token_id=tokenizer.pad_token_id, **MODEL))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def run_variant(name: str, model_dir: str, out: str, lengths: list[int]) -> list[dict]:
    sp, impl, ckpt = VARIANTS[name]
    worker = [os.path.join(REPO, "bench", "long_context_worker.py"), model_dir, out, ",".join(map(str, lengths)),
              impl, str(ckpt).lower()]
    if sp == 1:
        cmd = [sys.executable, *worker]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               os.path.join(REPO, "accelerate_configs", "zero3.yaml"), "--num_processes", str(sp),
               "--main_process_port", str(free_port()), *worker, "--sp", str(sp)]
    env = dict(os.environ, PYTHONPATH=REPO, MALLOC_MMAP_THRESHOLD_="65536", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    ranks = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out)) if f.startswith("rank")]
    rows = []
    for length in lengths:  # the worst rank and step at each length
        steps = [s for rank in ranks for s in rank["steps"] if s["length"] == length]
        rows.append({"length": length, "step": max(s["peak"] - s["rss_before"] for s in steps),
                     "peak": max(s["peak"] for s in steps), "seconds": max(s["seconds"] for s in steps)})
    return rows


def longest_within(rows: list[dict], budget: float) -> tuple[int | None, float | None]:
    """(longest measured length whose step fits the budget, the length where a line through the measured steps
    reaches it)."""
    fits = [r["length"] for r in rows if r["step"] <= budget]
    xs, ys = [r["length"] for r in rows], [r["step"] for r in rows]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-9)
    at = (budget - (my - slope * mx)) / slope if slope > 0 else None
    return (max(fits) if fits else None), at


def plot(results: dict, budget: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in results.items():
        style = "-" if name.startswith("sp2") else "--"
        ax.plot([r["length"] for r in rows], [r["step"] / GiB for r in rows], style, marker="o", label=name)
    ax.axhline(budget / GiB, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per sequence")
    ax.set_ylabel("step memory per rank (GiB)")
    ax.set_title("Peak memory of a training step per rank (CPU, fp32)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--budget-gib", type=float, default=1.0)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", default=os.path.join(REPO, "bench", "long_context.png"))
    ns = p.parse_args()
    budget = ns.budget_gib * GiB
    with tempfile.TemporaryDirectory(prefix="hftrain-longctx-") as tmp:
        model_dir = build_model(os.path.join(tmp, "model"))
        results = {name: run_variant(name, model_dir, os.path.join(tmp, name), ns.lengths) for name in ns.variants}
    print(f"{'variant':<18}" + "".join(f"{n:>10}" for n in ns.lengths) + "   (step memory per rank, GiB)")
    for name, rows in results.items():
        print(f"{name:<18}" + "".join(f"{r['step'] / GiB:>10.3f}" for r in rows))
    print(f"{'variant':<18}" + "".join(f"{n:>10}" for n in ns.lengths) + "   (peak resident set per rank, GiB)")
    for name, rows in results.items():
        print(f"{name:<18}" + "".join(f"{r['peak'] / GiB:>10.3f}" for r in rows))
    print(f"{'variant':<18}" + "".join(f"{n:>10}" for n in ns.lengths) + "   (seconds per step)")
    for name, rows in results.items():
        print(f"{name:<18}" + "".join(f"{r['seconds']:>10.1f}" for r in rows))
    print(f"\nlongest sequence whose step fits {ns.budget_gib:g} GiB per rank (measured; linear estimate):")
    for name, rows in results.items():
        measured, estimate = longest_within(rows, budget)
        print(f"  {name:<18}{measured or '-':>8}   ~{int(estimate) if estimate else '-'}")
    if "1p" in results and "sp2" in results:
        last = ns.lengths[-1]
        ratio = results["sp2"][-1]["step"] / results["1p"][-1]["step"]
        print(f"\nsp2 / 1p step memory per rank at {last} tokens: {ratio:.2f}")
    plot(results, budget, ns.out)
    print(f"plot: {ns.out}")


if __name__ == "__main__":
    main()
