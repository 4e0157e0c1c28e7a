"""Per-rank memory of each strategy on a ~100M-parameter model, 2 CPU ranks, against `hftrain plan`.

    python bench/memory.py [--steps 3] [--strategies ddp fsdp zero2 zero3 zero3_offload zero_infinity]

For each strategy it launches recipes/sft.py's pieces (bench/memory_worker.py) under `accelerate launch` with the
shipped config and reads, per rank, the resident set size before the model is built, after training (after a
gc), and at peak (VmHWM), and the bytes of every live tensor storage (model states and the engine's buffers;
each storage counted once; the most seen at an optimizer step, when a PyTorch engine holds parameters, gradients
and optimizer states at once, or after training) minus those before the model. "RSS growth" is RSS after
training minus RSS before the model: on a machine without GPU every byte lives in RAM, so this is model states plus
everything the engine keeps beside them (DDP's gradient buckets, DeepSpeed's communication and swap buffers,
allocator slack). Prints:
- the ZeRO-3 / DDP model-state ratio (goal <= 0.55 with 2 ranks);
- the share of model-state bytes that NVMe offload moves off RAM, against ZeRO-3 with CPU offload
  (goal >= 75%);
- the plan's error against each measurement (goal: within 15%).
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

MODEL = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
         "num_key_value_heads": 12, "max_position_embeddings": 512}


def main() -> None:
    from hftrain.launch.plan import plan
    from hftrain.launch.plan import model_facts
    from hftrain.tiny import build_tiny_model, texts_of_jsonl

    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--strategies", nargs="+",
                    default=["ddp", "fsdp", "zero2", "zero3", "zero3_offload", "zero_infinity"])
    ns = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="hftrain-mem-")
    model_dir = build_tiny_model(os.path.join(tmp, "base"),
                                 texts_of_jsonl([os.path.join(REPO, "data/demo/train.jsonl")]), config=MODEL)
    facts = model_facts(model_dir)
    print(f"model: {facts.params / 1e6:.1f}M parameters (fp32), 2 ranks, {ns.steps} steps", flush=True)
    rows = {r.strategy: r for r in plan(facts, gpus_per_node=2, nodes=1, micro_batch=2, seq=64,
                                          checkpointing=False, mixed=False)}
    measured = {}
    for name in ns.strategies:
        out = os.path.join(tmp, name)
        nvme = os.path.join(tmp, "nvme")
        os.makedirs(nvme, exist_ok=True)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               os.path.join(REPO, "accelerate_configs", f"{name}.yaml"), "--main_process_port", str(free_port()),
               os.path.join(REPO, "bench", "memory_worker.py"), model_dir, out, str(ns.steps), nvme]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0:
            # The workers' error, not the launcher's traceback that follows it.
            worker = r.stderr.split('Traceback (most recent call last):\n  File "<frozen runpy>"')[0]
            print(f"{name}: failed\n{worker[-3000:]}", flush=True)
            continue
        ranks = [json.load(open(os.path.join(out, f"mem_rank{i}.json"))) for i in range(2)]
        growth = max(x["rss_after_train"] - x["rss_before_model"] for x in ranks)
        states = max(x["tensor_bytes"] for x in ranks)
        peak = max(x["peak_rss"] for x in ranks)
        measured[name] = states
        if name in ("zero3_offload", "zero_infinity"):  # per rank: the node's CPU share + what a GPU would hold
            expect = rows[name].cpu_per_node / 2 + rows[name].gpu_model_states
        else:
            expect = rows[name].gpu_model_states  # on CPU, "GPU" memory is this rank's RAM
        print(f"{name:<14} tensors/rank {states / 2**20:7.0f} MiB   RSS growth/rank {growth / 2**20:7.0f} MiB   "
              f"peak RSS/rank {peak / 2**20:7.0f} MiB   plan {expect / 2**20:7.0f} MiB "
              f"(tensors {(states - expect) / expect:+.0%})", flush=True)
    if "ddp" in measured and "zero3" in measured:
        print(f"ZeRO-3 / DDP model-state (tensor) bytes: {measured['zero3'] / measured['ddp']:.2f} (goal <= 0.55)")
    if "ddp" in measured and "fsdp" in measured:
        print(f"FSDP2 / DDP model-state (tensor) bytes: {measured['fsdp'] / measured['ddp']:.2f}")
    if "zero3_offload" in measured and "zero_infinity" in measured:
        moved = 1 - measured["zero_infinity"] / measured["zero3_offload"]
        print(f"NVMe offload moves {moved:.0%} of the tensor bytes off RAM against CPU offload (goal >= 75%)")


if __name__ == "__main__":
    main()
