"""QLoRA against LoRA on the same model: a training step's time and memory, and the memory plan's figure.

    python bench/qlora.py [--size tiny|1b] [--steps 30] [--batch 8] [--seq 512] [--out FILE.json]

The same random-weight Llama-shaped model (`tiny`: hidden 256, 4 layers; `1b`: TinyLlama-1.1B's shape, hidden 2048,
22 layers, vocabulary 32000) is saved once, then loaded through hftrain.modeling.load_model twice: LoRA (r 16, every
linear layer) on the full-precision base, and QLoRA (the same adapter on a 4-bit NF4 base, double quantisation).
Each side trains `--steps` steps of AdamW on the same random token batches; the first 5 are warm-up. Measured per
side: the median step time (forward, backward, optimizer step; torch.cuda.synchronize on a GPU), the model states'
bytes (parameters, buffers, 4-bit constants, gradients, Adam's states: counted tensor by tensor after the steps),
and on a GPU the peak allocated memory of the step (torch.cuda.max_memory_allocated, activations included). The
plan's model-state figure (hftrain plan's ddp row on one GPU) is printed beside the counted one.

On a GPU the weights are bf16, the 4-bit layers compute in bf16 and the step runs under bf16 autocast, as a run with
training.bf16 does (peft's preparation keeps the norms, embeddings and head of a quantised base in fp32); on the CPU,
fp32 throughout.
Also printed on a GPU: the QLoRA loss against LoRA on the dequantised base with fp32 compute (the definition
tests/test_quantization.py checks on the CPU), as the largest relative difference over the first steps' losses.
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

from hftrain.config import LoraSection, ModelSection, QuantizationSection  # noqa: E402
from hftrain.modeling import load_model  # noqa: E402

SIZES = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=2048),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
}
LORA = LoraSection(r=16, alpha=32, dropout=0.0, target_modules="all-linear")


def save_base(size: str, folder: str, dtype: torch.dtype) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=4096, **SIZES[size])
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(folder, safe_serialization=True)
    return folder


def state_bytes(model, optimizer) -> int:
    import bitsandbytes as bnb

    tensors = [*model.parameters(), *model.buffers()]
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit) and m.weight.quant_state is not None:
            s = m.weight.quant_state
            tensors += [s.absmax, s.code] + ([s.state2.absmax, s.state2.code] if s.nested else [])
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    moments = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    return sum(t.numel() * t.element_size() for t in [*tensors, *grads, *moments])


def train(cfg: ModelSection, batches: list[torch.Tensor], device: str) -> dict:
    model = load_model(cfg)
    if device == "cuda" and cfg.quantization is None:
        model.to(device)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    times, losses = [], []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for ids in batches:
        ids = ids.to(device)
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):  # as training.bf16 runs it
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    out = {"step_s": statistics.median(times[5:]), "state_bytes": state_bytes(model, optimizer), "losses": losses}
    if device == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
    del model, optimizer
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def plan_state_bytes(folder: str, cfg: ModelSection, batch: int, seq: int) -> float | None:
    """hftrain plan's model states (ddp, one GPU), or None where hftrain.launch cannot be imported (a GPU machine
    with only the libraries the model needs: the plan is then read on another machine, from the same config)."""
    try:
        from hftrain.launch import plan as memory_plan
    except ImportError:
        return None
    facts = memory_plan.model_facts(folder, lora_r=LORA.r, dtype=cfg.dtype, quantization=cfg.quantization)
    rows = memory_plan.plan(facts, 1, 1, batch, seq, False, False)
    return next(r for r in rows if r.strategy == "ddp").gpu_model_states


def definition_check(folder: str, ids: torch.Tensor) -> dict:
    """QLoRA in fp32 compute against the same adapter on transformers' dequantised base (fp32, TF32 off): the loss's
    and the adapter gradients' largest differences."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from hftrain.quantization import bnb_config

    torch.backends.cuda.matmul.allow_tf32 = False
    quant = QuantizationSection(bits=4, type="nf4", compute_dtype="float32")
    cfg = ModelSection(name_or_path=folder, dtype="float32", lora=LORA, quantization=quant)
    qlora = load_model(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in qlora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g).to(p.device) * 0.01)
    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb_config(cfg), dtype=torch.float32,
                                                device_map={"": 0}).dequantize(torch.float32)
    ref = get_peft_model(base, qlora.peft_config["default"])
    set_peft_model_state_dict(ref, get_peft_model_state_dict(qlora))
    out = {}
    for name, model in (("qlora", qlora), ("ref", ref)):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out[name] = (loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad})
    (lq, gq), (lr, gr) = out["qlora"], out["ref"]
    return {"loss_qlora": lq, "loss_ref": lr, "loss_abs_diff": abs(lq - lr),
            "grad_max_abs_diff": max((gq[n] - gr[n]).abs().max().item() for n in gq),
            "grad_max_abs": max(g.abs().max().item() for g in gr.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--out")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    folder = save_base(args.size, tempfile.mkdtemp(prefix="qlora-bench-"), getattr(torch, dtype))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, SIZES[args.size]["vocab_size"], (args.batch, args.seq), generator=g)
               for _ in range(args.steps)]
    quant = QuantizationSection(bits=4, type="nf4", compute_dtype=dtype)
    sides = {"lora": ModelSection(name_or_path=folder, dtype=dtype, lora=LORA),
             "qlora": ModelSection(name_or_path=folder, dtype=dtype, lora=LORA, quantization=quant)}
    results = {name: train(cfg, batches, device) for name, cfg in sides.items()}
    for name, cfg in sides.items():
        results[name]["plan_state_bytes"] = plan_state_bytes(folder, cfg, args.batch, args.seq)
    if device == "cuda":
        results["definition"] = definition_check(folder, batches[0][:2, :128].to(device))
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "size": args.size,
              "batch": args.batch, "seq": args.seq, "steps": args.steps, **results}
    for name in sides:
        r = results[name]
        plan = r["plan_state_bytes"]
        print(f"{name:6} step {r['step_s'] * 1e3:8.1f} ms  model states {r['state_bytes'] / 2**30:7.3f} GiB "
              + (f"(plan {plan / 2**30:7.3f} GiB, {plan / r['state_bytes']:.3f}x)" if plan else "(plan: not here)")
              + (f"  peak {r['peak_bytes'] / 2**30:7.2f} GiB" if "peak_bytes" in r else ""))
    q, lo = results["qlora"], results["lora"]
    print(f"qlora / lora: step time {q['step_s'] / lo['step_s']:.2f}x, model states "
          f"{q['state_bytes'] / lo['state_bytes']:.2f}x" + (f", peak {q['peak_bytes'] / lo['peak_bytes']:.2f}x"
                                                           if "peak_bytes" in q else ""))
    if "definition" in results:
        print(f"definition (fp32 compute): {results['definition']}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
