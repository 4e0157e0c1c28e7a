"""Peak memory of distillation's divergence at a 128k vocabulary: hftrain's chunked divergence vs plain full-vocabulary
implementations, forward + backward, on CPU.

    python bench/distill_memory.py [--vocab 131072] [--tokens 1024 2048] [--impls ...]

Each (tokens, implementation) runs in a fresh subprocess (so each peak is its own). The inputs are what the trainer
hands the loss: the student's logits of the completion tokens ([tokens, vocab], fp32, requiring a gradient) and the
teacher's ([tokens, vocab], fp32, no gradient), both allocated and written, and each implementation run once on 2
tokens, before the measurement starts. The step is the divergence's sum (temperature 2), then its backward (which
writes the student logits' gradient, [tokens, vocab], in every implementation). Implementations:
- `plain_forward_kl`: torch's `F.kl_div` on both full log-softmaxes (log_target), KL(teacher || student);
- `trl_jsd`: TRL 1.16's `GKDTrainer.generalized_jsd_loss` (beta 0.5, reduction sum): full log-softmaxes and the
  stacked mixture;
- `chunked_forward_kl`, `chunked_jsd`: hftrain/methods/distill/divergence.py's `divergence_sum` (checkpointed chunks
  of tokens, losses.chunked_ce's chunk size for the vocabulary).
`step` is the child's ru_maxrss after the backward minus ru_maxrss just before the step (inputs already resident):
the divergence's own memory, the gradient included. `peak` is the child's ru_maxrss (libraries and inputs included).
The parent checks that each chunked value equals its plain counterpart (rel 1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

IMPLS = ("plain_forward_kl", "chunked_forward_kl", "trl_jsd", "chunked_jsd")
PLAIN_OF = {"chunked_forward_kl": "plain_forward_kl", "chunked_jsd": "trl_jsd"}
TEMPERATURE, BETA = 2.0, 0.5
GiB = 1024 ** 3


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def divergence(impl: str):
    """The implementation: (student logits, teacher logits) -> the divergence's sum over the tokens."""
    import torch.nn.functional as F

    from hftrain.methods.distill.divergence import DivergenceSpec, divergence_sum

    if impl == "plain_forward_kl":
        return lambda s, t: F.kl_div(F.log_softmax(s / TEMPERATURE, -1), F.log_softmax(t / TEMPERATURE, -1),
                                     reduction="sum", log_target=True)
    if impl == "trl_jsd":
        from trl.experimental.gkd.gkd_trainer import GKDTrainer

        return lambda s, t: GKDTrainer.generalized_jsd_loss(s[None], t[None], beta=BETA, temperature=TEMPERATURE,
                                                            reduction="sum")
    kind = "jsd" if impl == "chunked_jsd" else "forward_kl"
    return lambda s, t: divergence_sum(s, t, DivergenceSpec(kind, BETA, TEMPERATURE))


def child(vocab: int, tokens: int, impl: str) -> dict:
    import torch

    loss_of = divergence(impl)
    warm = torch.randn(2, vocab, requires_grad=True)
    loss_of(warm, torch.randn(2, vocab)).backward()  # lazy imports and first-call set-up before the measurement
    g = torch.Generator().manual_seed(0)
    student = (torch.randn(tokens, vocab, generator=g) * 3).requires_grad_(True)
    teacher = torch.randn(tokens, vocab, generator=g) * 3
    before = maxrss()
    loss = loss_of(student, teacher)
    loss.backward()
    after = maxrss()
    return {"loss": float(loss), "grad_sum": float(student.grad.abs().sum()), "step": after - before, "peak": after,
            "inputs": 2 * tokens * vocab * 4}


def run_child(vocab: int, tokens: int, impl: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--vocab", str(vocab), "--tokens", str(tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        return {"error": out.stderr[-800:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(vocab: int, results: dict) -> str:
    lines = ["| tokens x vocab | implementation | step memory | peak RSS | step / plain step | value |",
             "|---|---|---|---|---|---|"]
    for (tokens, impl), r in results.items():
        if "error" in r:
            lines.append(f"| {tokens} x {vocab} | {impl} | failed: {r['error'].splitlines()[-1]} | | | |")
            continue
        plain = results.get((tokens, PLAIN_OF.get(impl, impl)), {})
        ratio = f"{r['step'] / plain['step']:.3f}" if plain.get("step") else "-"
        lines.append(f"| {tokens} x {vocab} | {impl} | {r['step'] / GiB:.2f} GiB | {r['peak'] / GiB:.2f} GiB | "
                     f"{ratio} | {r['loss']:.6g} |")
    return "\n".join(lines)


def check_values(results: dict) -> None:
    """Each chunked divergence equals its plain counterpart (value and gradient's size), else the comparison fails."""
    for (tokens, impl), r in results.items():
        plain = results.get((tokens, PLAIN_OF.get(impl, "")))
        if impl in PLAIN_OF and plain and "loss" in r and "loss" in plain:
            for key in ("loss", "grad_sum"):
                if abs(r[key] - plain[key]) > 1e-5 * abs(plain[key]):
                    raise SystemExit(f"{impl} at {tokens} tokens: {key} {r[key]} differs from {plain[key]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--child", choices=IMPLS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.vocab, a.tokens[0], a.child)))
        return
    results = {}
    for tokens in a.tokens:
        for impl in a.impls:
            results[(tokens, impl)] = run_child(a.vocab, tokens, impl)
            print(f"{tokens} x {a.vocab} {impl}: {results[(tokens, impl)]}", file=sys.stderr, flush=True)
    check_values(results)
    print(table(a.vocab, results))


if __name__ == "__main__":
    main()
