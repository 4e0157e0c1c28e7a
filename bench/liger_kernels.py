"""liger-kernel's fused kernels (`model.kernels: liger`) against the model's own layers, on a CUDA GPU.

    python bench/liger_kernels.py [--steps 30] [--batch 8] [--seq 2048] [--out FILE.json]

A TinyLlama-1.1B-shaped model (hidden 2048, 22 layers, 32 heads, 4 KV heads, intermediate 5632, vocabulary 32000,
random weights, bf16, sdpa) is saved once and loaded twice through hftrain.modeling.load_model: as it is, and with
`kernels: liger` (liger's RMSNorm, RoPE and SwiGLU; the loss stays transformers' cross-entropy on both sides, as
hftrain keeps its own). Each side trains `--steps` steps of fused AdamW on the same random batches, the weights in
bf16; the first 5 steps are warm-up. Measured per side: the median step (forward, backward, optimizer step;
torch.cuda.synchronize), tokens per second from it, the peak allocated memory, and every step's loss (the two
sides' losses are compared step by step: kernels that compute the same function give the same losses up to bf16
rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hftrain.config import ModelSection  # noqa: E402
from hftrain.modeling import load_model  # noqa: E402

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)


def train(cfg: ModelSection, batches: list[torch.Tensor]) -> dict:
    model = load_model(cfg).to("cuda")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for ids in batches:
        ids = ids.to("cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    step = statistics.median(times[5:])
    out = {"step_s": step, "tokens_per_s": batches[0].numel() / step, "peak_bytes": torch.cuda.max_memory_allocated(),
           "losses": losses}
    del model, optimizer
    torch.cuda.empty_cache()
    return out


def main() -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--out")
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="kernels-bench-")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE)).to(torch.bfloat16).save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, SHAPE["vocab_size"], (args.batch, args.seq), generator=g) for _ in range(args.steps)]
    plain = dict(name_or_path=folder, dtype="bfloat16", attn_implementation="sdpa")
    results = {"plain": train(ModelSection(**plain), batches),
               "liger": train(ModelSection(**plain, kernels="liger"), batches)}
    p, lg = results["plain"], results["liger"]
    rel = max(abs(a - b) / abs(a) for a, b in zip(p["losses"], lg["losses"]))
    report = {"device": torch.cuda.get_device_name(), "batch": args.batch, "seq": args.seq, "steps": args.steps,
              "largest_relative_loss_difference": rel, **results}
    for name, r in results.items():
        print(f"{name:6} step {r['step_s'] * 1e3:8.1f} ms  {r['tokens_per_s']:9.0f} tokens/s  "
              f"peak {r['peak_bytes'] / 2**30:6.2f} GiB  loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
    print(f"liger / plain: step time {lg['step_s'] / p['step_s']:.3f}x, peak {lg['peak_bytes'] / p['peak_bytes']:.3f}x;"
          f" largest relative loss difference over the steps {rel:.2e}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
