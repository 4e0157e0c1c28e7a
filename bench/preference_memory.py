"""Memory of the reference model in preference tuning: recipes/dpo.py on a ~100M-parameter model, per variant.

    python bench/preference_memory.py [--steps 3] [--rows 128] [--variants sft frozen precompute lora simpo orpo kto
                                                                       kto_precompute]

Builds a Llama-style model from a config (fp32, hidden 768 x 12 layers, like bench/memory.py), then runs each variant
in a fresh process (1 process, CPU) on the first --rows pairs of data/demo/preference_train.jsonl for --steps steps:

- frozen:     the default: TRL loads a frozen full copy of the model as the reference;
- precompute: preference.precompute_ref_log_probs: true (reference log-probs computed once, no reference kept);
- lora:       model.lora: {r: 16} (the reference is the base model with the adapter disabled);
- simpo:      preference.loss_type: simpo (reference-free);
- orpo:       preference.loss_type: orpo (reference-free; TRL's ORPOTrainer computes the full logits);
- kto:        preference.loss_type: kto, the pairs split in two (4 examples a step, each with its KL completion), a
              frozen reference copy; kto_precompute: with precompute_ref_log_probs;
- sft:        plain transformers Trainer SFT of the same model on the chosen answers (baseline, no reference).

Per process it reads the peak resident set size (VmHWM) and, after training, the bytes of the policy's and the
reference's parameter storages (each storage once; a LoRA policy's frozen base counted once) and of every live CPU
tensor (parameters, gradients, AdamW states). Prints a markdown table with ratios against the frozen-copy run.
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
VARIANTS = {
    "frozen": [],
    "precompute": ["preference.precompute_ref_log_probs=true"],
    "lora": ["model.lora.r=16"],
    "simpo": ["preference.loss_type=simpo"],
    "orpo": ["preference.loss_type=orpo"],
    "kto": ["preference.loss_type=kto"],
    "kto_precompute": ["preference.loss_type=kto", "preference.precompute_ref_log_probs=true"],
}
LABELS = {"sft": "SFT, plain `Trainer` (baseline)", "frozen": "DPO, frozen reference copy (default)",
          "precompute": "DPO, `precompute_ref_log_probs: true`", "lora": "DPO, `model.lora: {r: 16}`",
          "simpo": "SimPO (`loss_type: simpo`)", "orpo": "ORPO (`loss_type: orpo`)",
          "kto": "KTO (`loss_type: kto`), frozen reference copy",
          "kto_precompute": "KTO, `precompute_ref_log_probs: true`"}


def measure(trainer) -> dict:
    gc.collect()
    seen: set = set()
    policy = storage_bytes(trainer.model.parameters(), seen)
    ref = getattr(trainer, "ref_model", None)
    return {"policy_bytes": policy, "ref_bytes": storage_bytes(ref.parameters(), seen) if ref is not None else 0,
            "has_ref_model": ref is not None, "tensor_bytes": tensor_bytes()}


def worker(variant: str, model_dir: str, data: str, out: str, steps: int) -> None:
    """One variant in this process; writes OUT/mem.json."""
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    report: dict = {"rss_before": rss()}
    common = ["data.max_length=64", f"training.output_dir={out}", f"training.max_steps={steps}",
              "training.per_device_train_batch_size=4", "training.save_strategy=no", "training.report_to=none",
              "training.disable_tqdm=true", "training.logging_steps=1", "training.learning_rate=1e-5",
              "training.warmup_steps=0", "training.eval_strategy=no"]
    if variant == "sft":
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

        tok = AutoTokenizer.from_pretrained(model_dir)
        rows = [json.loads(line) for line in open(data)]
        texts = [r["prompt"][0]["content"] + " " + r["chosen"][0]["content"] for r in rows]
        enc = [tok(t, truncation=True, max_length=64)["input_ids"] for t in texts]

        def collate(batch):
            n = max(len(x) for x in batch)
            ids = torch.full((len(batch), n), tok.pad_token_id or 0)
            labels = torch.full((len(batch), n), -100)
            for i, x in enumerate(batch):
                ids[i, :len(x)] = torch.tensor(x)
                labels[i, :len(x)] = torch.tensor(x)
            return {"input_ids": ids, "attention_mask": (labels != -100).long(), "labels": labels}

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=4, save_strategy="no",
                                 report_to="none", disable_tqdm=True, logging_steps=1, learning_rate=1e-5,
                                 use_cpu=True)
        trainer = Trainer(model=model, args=args, train_dataset=enc, data_collator=collate)
        trainer.train()
        report.update(measure(trainer))
    else:
        from hftrain.trainer import StagedCheckpointMixin  # the first train() of every preference trainer

        train = StagedCheckpointMixin.train

        def measured_train(self, *a, **k):
            result = train(self, *a, **k)
            report.update(measure(self))
            return result

        StagedCheckpointMixin.train = measured_train
        argv = [os.path.join(REPO, "recipes", "demo", "dpo.yaml"), f"model.name_or_path={model_dir}",
                f"data.sources.0.path={data}", "data.eval_sources=[]", *common, *VARIANTS[variant]]
        from hftrain.recipes import dpo

        dpo.main(argv)
    gc.collect()
    report["peak_rss"] = rss("VmHWM")
    with open(os.path.join(out, "mem.json"), "w") as fh:
        json.dump(report, fh)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=128, help="pairs of the shipped set used (precompute reads them all)")
    ap.add_argument("--variants", nargs="+", default=list(LABELS), choices=list(LABELS))
    ap.add_argument("--worker", nargs=5, metavar=("VARIANT", "MODEL", "DATA", "OUT", "STEPS"), help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.worker:
        v, model_dir, data, out, steps = ns.worker
        worker(v, model_dir, data, out, int(steps))
        return

    from hftrain.tiny import build_tiny_model, texts_of_jsonl

    tmp = tempfile.mkdtemp(prefix="hftrain-prefmem-")
    model_dir = build_tiny_model(os.path.join(tmp, "base"),
                                 texts_of_jsonl([os.path.join(REPO, "data/demo/train.jsonl")]), config=MODEL)
    data = os.path.join(tmp, "pairs.jsonl")
    with open(os.path.join(REPO, "data/demo/preference_train.jsonl")) as src, open(data, "w") as dst:
        dst.writelines(line for i, line in enumerate(src) if i < ns.rows)
    results = {}
    for v in ns.variants:
        out = os.path.join(tmp, v)
        os.makedirs(out, exist_ok=True)
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", v, model_dir, data, out,
                            str(ns.steps)], cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0 or not os.path.exists(os.path.join(out, "mem.json")):
            print(f"{v}: failed\n{r.stderr[-3000:]}", flush=True)
            continue
        results[v] = json.load(open(os.path.join(out, "mem.json")))
        x = results[v]
        print(f"{v:<11} peak RSS {x['peak_rss'] / 2**20:6.0f} MiB  policy params {x['policy_bytes'] / 2**20:5.0f} MiB  "
              f"reference params {x['ref_bytes'] / 2**20:5.0f} MiB  live tensors {x['tensor_bytes'] / 2**20:5.0f} MiB",
              flush=True)
    params = next(iter(results.values()))["policy_bytes"] / 4 if results else 0
    print(f"\nmodel: {params / 1e6:.0f}M parameters (fp32), 1 process (CPU), {ns.steps} steps, batch 4 pairs, "
          f"{ns.rows} pairs\n")
    base = results.get("frozen")
    print("| run | peak RSS | vs frozen | policy params | reference params | live tensors | vs frozen |")
    print("|---|---|---|---|---|---|---|")
    for v, x in results.items():
        rss_ratio = f"{x['peak_rss'] / base['peak_rss']:.2f}" if base else "-"
        t_ratio = f"{x['tensor_bytes'] / base['tensor_bytes']:.2f}" if base else "-"
        print(f"| {LABELS[v]} | {x['peak_rss'] / 2**20:.0f} MiB | {rss_ratio} | {x['policy_bytes'] / 2**20:.0f} MiB | "
              f"{x['ref_bytes'] / 2**20:.0f} MiB | {x['tensor_bytes'] / 2**20:.0f} MiB | {t_ratio} |")


if __name__ == "__main__":
    main()
