"""Peak memory and tokens/s of one training step at large vocabularies: hftrain's chunked loss vs plain Trainer.

    python bench/loss_memory.py [--vocab 32768 131072 262144] [--tokens 2048 8192] [--hidden 64] [--steps 3]
                                [--max-logits-gib 3] [--out bench/loss_memory.png]
    python bench/loss_memory.py --alternate 6 [--vocab ...] [--tokens ...]     (speed only, see below)

Each (vocabulary, tokens, implementation) is measured in a fresh subprocess (so each peak is its own), on CPU, or on
the GPU when one is present (then CUDA max allocated instead of RSS). A step is forward + backward of one row of
`tokens` tokens, every token a target (the chunked loss's worst case: prompt tokens are never projected), on a
1-layer Llama with a small hidden size, so that the output head and the loss dominate as they do at 128k+
vocabularies. Implementations:
- `plain`: transformers' Trainer.compute_loss, labels passed to the model (its own loss, from the full logits);
- `hftrain_logits`: SFTTrainer.compute_loss with training.loss_impl: logits (the full logits, upcast to fp32);
- `hftrain_chunked`: SFTTrainer.compute_loss with training.loss_impl: chunked (chunked_ce.py).
Peak RSS is the child's ru_maxrss after the steps; `step` is that minus ru_maxrss before the first step (model,
optimizer-free: the step's own memory). tokens/s is over the steps after the first. Configurations whose full fp32
logits exceed --max-logits-gib are skipped for the logits implementations (the machine is shared).
On a shared machine wall-clock tokens/s swing with the other jobs; `--alternate REPS` measures speed alone:
one process, one thread, the implementations' steps alternated, median CPU time per step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

IMPLS = ("plain", "hftrain_logits", "hftrain_chunked")


def child(vocab: int, tokens: int, impl: str, hidden: int, steps: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from hftrain.config import HFTrainingArguments
    from hftrain.methods.sft import SFTTrainer

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False, use_cache=False)
    model = LlamaForCausalLM(cfg).to(device).train()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=not cuda, report_to="none")
    if impl == "plain":
        trainer = Trainer(model=model, args=args)
    else:
        args = HFTrainingArguments(output_dir=args.output_dir, use_cpu=not cuda, report_to="none",
                                   loss_impl=impl.removeprefix("hftrain_"))
        trainer = SFTTrainer(model=model, args=args)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.max_memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    timed = times[1:] or times
    return {"vocab": vocab, "tokens": tokens, "impl": impl, "device": device, "peak_bytes": peak,
            "step_bytes": peak - before, "tokens_per_s": tokens * len(timed) / sum(timed), "loss": losses[0]}


def alternate(vocab: int, tokens: int, hidden: int, reps: int) -> dict:
    """tokens per CPU-second of each implementation, steps alternated in one process on one thread (medians of the
    reps after the first): a shared machine's load moves every implementation alike."""
    import statistics

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from hftrain.config import HFTrainingArguments
    from hftrain.methods.sft import SFTTrainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False, use_cache=False)
    model = LlamaForCausalLM(cfg).train()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none")
    trainers = {"plain": Trainer(model=model, args=args),
                **{i: SFTTrainer(model=model, args=HFTrainingArguments(output_dir=args.output_dir, use_cpu=True,
                                                                       report_to="none",
                                                                       loss_impl=i.removeprefix("hftrain_")))
                   for i in IMPLS[1:]}}
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for _ in range(reps):
        for name, trainer in trainers.items():
            t0 = time.process_time()
            trainer.compute_loss(model, dict(batch)).backward()
            times[name].append(time.process_time() - t0)
            model.zero_grad(set_to_none=True)
    return {k: tokens / statistics.median(v[1:] or v) for k, v in times.items()}


def measure(vocab: int, tokens: int, impl: str, hidden: int, steps: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps([vocab, tokens, impl, hidden, steps])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return {"vocab": vocab, "tokens": tokens, "impl": impl, "error": (r.stderr or r.stdout)[-500:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    gib = 2**30
    lines = [f"{'vocab':>7} {'tokens':>6} {'impl':<16} {'peak GiB':>9} {'step GiB':>9} {'tok/s':>9} "
             f"{'peak/plain':>10} {'tok/s / plain':>13} {'loss':>8}"]
    plain = {(r["vocab"], r["tokens"]): r for r in rows if r["impl"] == "plain" and "peak_bytes" in r}
    for r in rows:
        if "peak_bytes" not in r:
            lines.append(f"{r['vocab']:>7} {r['tokens']:>6} {r['impl']:<16} {r.get('error', 'skipped')[:60]}")
            continue
        p = plain.get((r["vocab"], r["tokens"]))
        ratio = f"{r['peak_bytes'] / p['peak_bytes']:.2f}" if p else "-"
        speed = f"{r['tokens_per_s'] / p['tokens_per_s']:.2f}" if p else "-"
        lines.append(f"{r['vocab']:>7} {r['tokens']:>6} {r['impl']:<16} {r['peak_bytes'] / gib:>9.2f} "
                     f"{r['step_bytes'] / gib:>9.2f} {r['tokens_per_s']:>9.0f} {ratio:>10} {speed:>13} "
                     f"{r['loss']:>8.4f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    from hftrain.fileio import pyplot, save_figure

    plt = pyplot()
    done = [r for r in rows if "peak_bytes" in r]
    configs = sorted({(r["vocab"], r["tokens"]) for r in done})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(IMPLS)
    for i, impl in enumerate(IMPLS):
        by = {(r["vocab"], r["tokens"]): r for r in done if r["impl"] == impl}
        xs = [k + i * width for k, c in enumerate(configs) if c in by]
        axes[0].bar(xs, [by[c]["peak_bytes"] / 2**30 for c in configs if c in by], width, label=impl)
        axes[1].bar(xs, [by[c]["tokens_per_s"] for c in configs if c in by], width, label=impl)
    labels = [f"{v // 1024}k vocab\n{t} tok" for v, t in configs]
    for ax, title in zip(axes, ("peak memory (GiB)", "tokens / s")):
        ax.set_xticks([k + width for k in range(len(configs))], labels, fontsize=8)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    device = done[0]["device"] if done else "cpu"
    fig.suptitle(f"one training step, 1-layer Llama, {'CUDA max allocated' if device == 'cuda' else 'peak RSS'}")
    fig.tight_layout()
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072, 262144])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-logits-gib", type=float, default=3.0)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "loss_memory.png"))
    ap.add_argument("--alternate", type=int, metavar="REPS",
                    help="instead: tokens per CPU-second, implementations alternated in one process on one thread")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*json.loads(a.child))))
        return
    if a.alternate:
        for vocab in a.vocab:
            for tokens in a.tokens:
                speed = alternate(vocab, tokens, a.hidden, a.alternate)
                print(f"{vocab:>7} {tokens:>6} " + "  ".join(
                    f"{k} {v:.0f} tok/cpu-s ({v / speed['plain']:.2f}x)" for k, v in speed.items()), flush=True)
        return
    rows = []
    for vocab in a.vocab:
        for tokens in a.tokens:
            for impl in a.impls:
                if impl != "hftrain_chunked" and tokens * vocab * 4 / 2**30 > a.max_logits_gib:
                    rows.append({"vocab": vocab, "tokens": tokens, "impl": impl,
                                 "error": f"skipped: fp32 logits > {a.max_logits_gib} GiB"})
                else:
                    rows.append(measure(vocab, tokens, impl, a.hidden, a.steps))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    plot(rows, a.out)
    print(f"plot: {a.out}")


if __name__ == "__main__":
    main()
