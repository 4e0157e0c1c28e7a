"""GRPO's cost per variant: recipes/grpo.py on a ~100M-parameter model, seconds per step and the reference's memory.

    python bench/grpo.py [--steps 3] [--variants none frozen lora]

Builds a Llama-style model from a config (fp32, hidden 768 x 12 layers, as bench/preference_memory.py), then runs each
variant in a fresh process (1 process, CPU) on the shipped letter-reversal prompts (data/demo/train.jsonl), 8 prompts
x 4 completions of up to 16 tokens per step, rewarded by exact match:

- none:   grpo.beta: 0 (the default): no reference model;
- frozen: grpo.beta: 0.04: TRL loads a frozen full copy of the model as the reference;
- lora:   grpo.beta: 0.04 with model.lora: {r: 16}: the reference is the policy with the adapter disabled (no copy).

Per process: peak resident set size (VmHWM), the bytes of the policy's and the reference's parameter storages and of
every live CPU tensor after training (bench/memory_worker.py's functions), and the mean step time TRL logs
(step_time: generation, scoring, the reference's and the policy's forward and backward). Prints a markdown table
with ratios against the run without a reference.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from memory_worker import rss, storage_bytes, tensor_bytes  # noqa: E402  bench/memory.py's measurements

MODEL = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
         "num_key_value_heads": 12, "max_position_embeddings": 512}
VARIANTS = {"none": [], "frozen": ["grpo.beta=0.04"], "lora": ["grpo.beta=0.04", "model.lora.r=16"]}
LABELS = {"none": "`grpo.beta: 0` (no reference, default)", "frozen": "`beta: 0.04`, frozen reference copy",
          "lora": "`beta: 0.04`, `model.lora: {r: 16}` (adapter disabled)"}


def worker(variant: str, model_dir: str, out: str, steps: int) -> None:
    """One variant in this process; writes OUT/result.json."""
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    import hftrain.methods.grpo.grpo as grpo

    report: dict = {"rss_before": rss()}
    train = grpo.GroupTrainer.train

    def measured_train(self, *a, **k):
        result = train(self, *a, **k)
        gc.collect()
        seen: set = set()
        ref = getattr(self, "ref_model", None)
        times = [h["step_time"] for h in self.state.log_history if "step_time" in h]
        report.update(policy_bytes=storage_bytes(self.model.parameters(), seen),
                      ref_bytes=storage_bytes(ref.parameters(), seen) if ref is not None else 0,
                      tensor_bytes=tensor_bytes(), step_s=sum(times[1:]) / max(1, len(times) - 1))
        return result

    grpo.GroupTrainer.train = measured_train
    from hftrain.recipes import grpo as recipe

    recipe.main([os.path.join(REPO, "recipes", "demo", "grpo.yaml"), f"model.name_or_path={model_dir}",
                 "data.eval_sources=[]", "eval.exact_match=0", f"training.output_dir={out}",
                 f"training.max_steps={steps}", "training.per_device_train_batch_size=32", "grpo.num_generations=4",
                 "training.report_to=none", "training.disable_tqdm=true", "training.logging_steps=1",
                 "training.overwrite_output_dir=true", *VARIANTS[variant]])
    report["peak_rss"] = rss("VmHWM")
    with open(os.path.join(out, "result.json"), "w") as fh:
        json.dump(report, fh)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps (the first is left out of the step time)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--worker", nargs=4, metavar=("VARIANT", "MODEL", "OUT", "STEPS"), help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.worker:
        v, model_dir, out, steps = ns.worker
        worker(v, model_dir, out, int(steps))
        return

    from hftrain.tiny import build_tiny_model, texts_of_jsonl

    tmp = tempfile.mkdtemp(prefix="hftrain-grpo-bench-")
    model_dir = build_tiny_model(os.path.join(tmp, "base"),
                                 texts_of_jsonl([os.path.join(REPO, "data/demo/train.jsonl")]), config=MODEL)
    results = {}
    for v in ns.variants:
        out = os.path.join(tmp, v)
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", v, model_dir, out, str(ns.steps)],
                           cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0 or not os.path.exists(os.path.join(out, "result.json")):
            print(f"{v}: failed\n{r.stderr[-3000:]}", flush=True)
            continue
        results[v] = x = json.load(open(os.path.join(out, "result.json")))
        print(f"{v:<7} {x['step_s']:6.1f} s/step  peak RSS {x['peak_rss'] / 2**20:6.0f} MiB  reference params "
              f"{x['ref_bytes'] / 2**20:5.0f} MiB  live tensors {x['tensor_bytes'] / 2**20:5.0f} MiB", flush=True)
    params = next(iter(results.values()))["policy_bytes"] / 4 if results else 0
    print(f"\nmodel: {params / 1e6:.0f}M parameters (fp32), 1 process (CPU), {ns.steps} steps of 8 prompts x 4 "
          "completions (up to 16 tokens)\n")
    base = results.get("none")
    print("| run | s/step | vs none | peak RSS | vs none | reference params | live tensors |")
    print("|---|---|---|---|---|---|---|")
    for v, x in results.items():
        ratio = lambda k: f"{x[k] / base[k]:.2f}" if base else "-"  # noqa: E731
        print(f"| {LABELS[v]} | {x['step_s']:.1f} | {ratio('step_s')} | {x['peak_rss'] / 2**20:.0f} MiB | "
              f"{ratio('peak_rss')} | {x['ref_bytes'] / 2**20:.0f} MiB | {x['tensor_bytes'] / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
