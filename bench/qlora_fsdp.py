"""QLoRA under FSDP2 against QLoRA without it, in one process (world size 1: FSDP's casts and all-gathers, not its
sharding across ranks, which tests/test_quantization_runs.py covers on 2 CPU ranks): for each 4-bit storage dtype,
the loss and the adapter's gradients with FSDP2's mixed precision (param_dtype = the compute dtype) against the same
model unwrapped. Storage in the compute dtype must agree; float32 storage under bf16 is the negative control (FSDP
casts the packed bytes). Prints one JSON line per storage dtype.

    python bench/qlora_fsdp.py [--hidden 1024 --layers 4 --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist


def build_base(folder: str, hidden: int, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), vocab_size=32000,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder)


def qlora(folder: str, storage: torch.dtype, compute: torch.dtype, device):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute,
                           bnb_4bit_quant_storage=storage, bnb_4bit_use_double_quant=True)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, dtype=compute,
                                                 device_map={"": device})
    torch.manual_seed(0)
    lora = LoraConfig(r=16, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    model = get_peft_model(model, lora)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # FSDP2: one dtype for the trainable parameters, cast by its policy
    return model


def step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float()
             for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), grads


def compare(folder, storage, compute, device, ids) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.autocast(device.type, dtype=compute):
        ref_loss, ref_grads = step(qlora(folder, storage, compute, device), ids)
    model = qlora(folder, storage, compute, device)
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    try:
        with torch.autocast(device.type, dtype=compute):
            loss, grads = step(model, ids)
    except RuntimeError as e:
        return {"storage": str(storage), "error": str(e)[:200]}
    rel = max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in ref_grads.items())
    return {"storage": str(storage), "compute": str(compute), "loss": loss, "ref_loss": ref_loss,
            "loss_rel_diff": abs(loss - ref_loss) / abs(ref_loss), "grad_max_rel_diff": rel, "grads": len(grads)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    compute = getattr(torch, args.dtype)
    ids = torch.randint(0, 32000, (2, 256), generator=torch.Generator().manual_seed(1)).to(device)
    with tempfile.TemporaryDirectory() as folder:
        build_base(folder, args.hidden, args.layers)
        for storage in (compute, torch.float32) if compute != torch.float32 else (torch.float32,):
            print(json.dumps({"device": torch.cuda.get_device_name(0) if cuda else "cpu",
                              **compare(folder, storage, compute, device, ids)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
