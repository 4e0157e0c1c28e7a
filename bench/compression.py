"""Gradient compression on the demo task, 2 CPU ranks, equal steps: bytes per step and the loss it costs.

    python bench/compression.py [--steps 150] [--config '{"hidden_size": 512, ...}'] [--methods none int8 ...]
                                [--workdir DIR] [--reuse]

Each method trains the same model (random init, same seed) on data/demo with recipes/sft.py under
`accelerate launch` (DDP, 2 processes). Reported per method, from the run's own trainer_state.json / run_info.json:
- the bytes-per-step ratio (comm/bytes_raw / comm/bytes_sent, averaged over the compressed steps: the steps
  before compression.start_step send uncompressed gradients);
- the final held-out eval loss and its gap to the uncompressed run, relative to that run's final loss and to the
  loss it took off during training (when the task is learnt, the final loss is near 0 and its relative gap is
  mostly seed noise), the final train loss (mean of the last 5 logged), and the exact-match accuracy of greedy
  answers on 200 held-out prompts.
Compression ratios depend on the matrix shapes (PowerSGD sends (n + m) * r for an n x m matrix), so the default
model is wider than the demo's (hidden 512, MLP 2048). On 2 CPU ranks the all-reduce is a memcpy through
loopback: wall time says nothing about a slow network, bytes do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.support import free_port  # noqa: E402
MODEL = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 8}
START = 10  # PowerSGD and top-k send uncompressed gradients for the first START steps
METHODS = {
    "none": [],
    "fp16": [],
    "bf16": [],
    "int8": [],
    "powersgd": ["compression.powersgd_rank=4", f"compression.start_step={START}"],
    "topk": ["compression.topk_ratio=0.01", f"compression.start_step={START}"],
}


def run_method(name: str, base: str, out: str, steps: int, reuse: bool = False) -> dict:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml",
           "--main_process_port", str(free_port()), "recipes/sft.py", "recipes/demo/sft.yaml",
           f"model.name_or_path={base}", f"training.output_dir={out}", f"training.max_steps={steps}",
           "training.logging_steps=5", "training.eval_strategy=no", "training.report_to=none",
           "training.disable_tqdm=true", "training.learning_rate=1e-3", "training.warmup_steps=10",
           "training.overwrite_output_dir=true",  # a --workdir given again re-runs each method from scratch
           f"compression.method={name}", *METHODS[name]]
    if not (reuse and os.path.exists(os.path.join(out, "run_info.json"))):
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    info = json.load(open(os.path.join(out, "run_info.json")))
    logs = [h for h in json.load(open(os.path.join(out, "trainer_state.json")))["log_history"] if "loss" in h]
    start = START if any(o.startswith("compression.start_step=") for o in METHODS[name]) else 0
    compressed = [h for h in logs if h["step"] > start + 5 and "comm/bytes_sent" in h]  # windows after warm-up
    ratio = (sum(h["comm/bytes_raw"] for h in compressed) / sum(h["comm/bytes_sent"] for h in compressed)
             if compressed else 1.0)
    m = info["metrics"]
    return {"method": name, "ratio": ratio, "eval_loss": m["final_eval_loss"],
            "train_loss": sum(h["loss"] for h in logs[-5:]) / len(logs[-5:]),
            "exact_match": m.get("final_exact_match"), "time_share": sum(
                h.get("comm/time_share", 0) for h in compressed) / max(len(compressed), 1),
            "runtime": m["train_runtime"], "initial_eval_loss": m["initial_eval_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--config", default=json.dumps(MODEL))
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--workdir", default=os.path.join(REPO, "runs", "bench_compression"))
    ap.add_argument("--reuse", action="store_true",
                    help="read the finished runs in --workdir (same steps and model) instead of training again")
    ns = ap.parse_args()
    base = os.path.join(ns.workdir, "base")
    if not (ns.reuse and os.path.isdir(base)):
        subprocess.run([sys.executable, "-m", "hftrain.cli", "tiny-model", "--data", "data/demo/train.jsonl",
                       "--output", base, "--config", ns.config], cwd=REPO, check=True, capture_output=True)
    methods = ["none", *[m for m in ns.methods if m != "none"]]
    rows = []
    for name in methods:
        rows.append(run_method(name, base, os.path.join(ns.workdir, name), ns.steps, ns.reuse))
        print(f"  {name}: done ({rows[-1]['runtime']:.0f} s)", flush=True)
    ref = rows[0]
    print(f"\n{ns.steps} steps, 2 ranks (DDP, gloo), model {ns.config}\n")
    print("| method | bytes/step ratio | final eval loss | gap vs none | gap / loss drop | final train loss "
          "| exact match | comm time share |")
    print("|---|---|---|---|---|---|---|---|")
    drop = ref["initial_eval_loss"] - ref["eval_loss"]  # what uncompressed training took off the held-out loss
    for r in rows:
        gap = (r["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]
        em = "-" if r["exact_match"] is None else f"{r['exact_match']:.2f}"
        share = "-" if r["method"] == "none" else f"{r['time_share']:.2f}"  # no hook, nothing timed
        print(f"| {r['method']} | {r['ratio']:.2f}x | {r['eval_loss']:.4f} | {gap:+.1%} | "
              f"{(r['eval_loss'] - ref['eval_loss']) / drop:+.2%} | {r['train_loss']:.4f} | {em} | {share} |")


if __name__ == "__main__":
    main()
