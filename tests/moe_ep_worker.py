"""2-rank check of hftrain.moe.expert_parallel (run by tests/test_moe.py with torchrun): the expert-parallel layer's
output and gradients equal the native Mixtral block's / the local layer's on the same input; the experts' gradients
stay divided by the world size when the layer's Parameters are re-created (the old hook on the Parameters did not);
a trainer's save_model writes every expert although nothing gathered them before it."""

import copy

import json
import sys

import torch
import torch.distributed as dist
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from hftrain.moe import expert_parallel as ep_module
from hftrain.moe.expert_parallel import ExpertParallelMoE

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # same block on every rank
cfg = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
block = MixtralSparseMoeBlock(cfg)
with torch.no_grad():
    for p in block.parameters():
        p.normal_(0, 0.5)
# different tokens per rank, uneven per expert; rank 1's batch is longer: the splits are uneven both ways
xs = [torch.randn(2, 5 + 3 * r, 16, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
cs = [torch.randn_like(x) for x in xs]  # loss_r = sum(y_r * c_r)
report = {"rank": rank}


def run(layer, x, c):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (y * c).sum().backward()
    return y.detach(), x.grad


for cf in (None, 1.0, 0.5):
    ep = ExpertParallelMoE(block, dist.group.WORLD, capacity_factor=cf)
    y, gx = run(ep, xs[rank], cs[rank])
    g_router = ep.gate.weight.grad.clone()  # the router module is the block's (shared with the reference)
    lo, hi = rank * ep.local, (rank + 1) * ep.local
    # the reference on every rank's input: native block (no capacity) or the same layer with local experts
    ref_layer = block if cf is None else ExpertParallelMoE(block, None, capacity_factor=cf)
    block.zero_grad()
    ref_layer.zero_grad()
    refs = [run(ref_layer, xs[r], cs[r]) for r in range(world)]
    ref_experts = ref_layer.experts
    dropped = ep.last_dropped
    ref_dropped = ExpertParallelMoE(block, None, capacity_factor=cf)
    ref_dropped(xs[rank])
    errs = {
        "out": float((y - refs[rank][0]).abs().max()),
        "grad_input": float((gx - refs[rank][1]).abs().max()),
        # a local expert's gradient sums every rank's tokens routed to it, divided by the world size (ScaleGrad; in
        # training the loss is scaled by the data-parallel size, so the two cancel)
        "grad_gate_up": float((ep.experts.gate_up_proj.grad - ref_experts.gate_up_proj.grad[lo:hi] / world)
                              .abs().max()),
        "grad_down": float((ep.experts.down_proj.grad - ref_experts.down_proj.grad[lo:hi] / world).abs().max()),
        "grad_scale": float(ref_experts.gate_up_proj.grad.abs().max()),
        "out_scale": float(refs[rank][0].abs().max()), "grad_input_scale": float(refs[rank][1].abs().max()),
        "dropped": dropped, "ref_dropped": ref_dropped.last_dropped,
    }
    # the router's gradient comes from this rank's loss only (no DDP here): compare with the reference on x_rank
    block.zero_grad()
    ref_layer.zero_grad()
    run(ref_layer, xs[rank], cs[rank])
    errs["grad_router"] = float((g_router - ref_layer.gate.weight.grad).abs().max())
    report[str(cf)] = errs
    block.zero_grad()

    # saving: the gathered experts equal the block's
    ep.gather_for_save()
    sd = ep.state_dict()
    report[str(cf)]["saved_full"] = bool(torch.equal(sd["experts.gate_up_proj"], block.experts.gate_up_proj.detach()))
    # loading a full (native) state dict keeps this rank's slice
    fresh = ExpertParallelMoE(block, dist.group.WORLD, capacity_factor=cf)
    with torch.no_grad():
        fresh.experts.down_proj.zero_()
    fresh.load_state_dict({k: v.clone() for k, v in sd.items()})
    report[str(cf)]["loaded_slice"] = bool(torch.equal(fresh.experts.down_proj,
                                                       block.experts.down_proj.detach()[lo:hi]))



def recreated(layer: ExpertParallelMoE, full: dict) -> ExpertParallelMoE:
    """The layer's Parameters re-created as loading does: new Parameter objects, then empty tensors filled from the
    native (full) state dict."""
    for name in ("gate_up_proj", "down_proj"):
        setattr(layer.experts, name, torch.nn.Parameter(getattr(layer.experts, name).detach().clone()))
    layer.to_empty(device="cpu")
    layer.load_state_dict(full)
    return layer


full = {k: v.detach().clone() for k, v in block.state_dict().items()}
ref_grads = []
for r in range(world):  # the expert gradients of every rank's loss on one layer with all experts
    block.zero_grad()
    run(block, xs[r], cs[r])
    ref_grads.append(block.experts.gate_up_proj.grad.clone())
want = sum(ref_grads)[rank * 2:(rank + 1) * 2] / world  # 4 experts over 2 ranks
layer = recreated(ExpertParallelMoE(copy.deepcopy(block), dist.group.WORLD), full)
run(layer, xs[rank], cs[rank])
report["recreated_grad"] = float((layer.experts.gate_up_proj.grad - want).abs().max() / want.abs().max())
# Negative control, the old way: a hook on the Parameters, no scaling in the forward; re-created, the hook is gone
ep_module.scale_grad, scaled = (lambda weight, scale: weight), ep_module.scale_grad
hooked = ExpertParallelMoE(copy.deepcopy(block), dist.group.WORLD)
for p in (hooked.experts.gate_up_proj, hooked.experts.down_proj):
    p.register_hook(lambda g: g / world)
run(hooked, xs[rank], cs[rank])
report["hook_kept_grad"] = float((hooked.experts.gate_up_proj.grad - want).abs().max() / want.abs().max())
hooked = recreated(hooked, full)
run(hooked, xs[rank], cs[rank])
report["hook_recreated_ratio"] = float(hooked.experts.gate_up_proj.grad.abs().max() / want.abs().max())
ep_module.scale_grad = scaled

# Every save writes all experts: save_model right after the experts changed, with nothing gathered before it
from transformers import MixtralForCausalLM  # noqa: E402

from hftrain.config import HFTrainingArguments  # noqa: E402
from hftrain.methods.sft import SFTTrainer  # noqa: E402

torch.manual_seed(1)
model = MixtralForCausalLM(MixtralConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                         num_experts_per_tok=2))
expected = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone() * 1.5
ep_module.parallelize(model, dist.group.WORLD)
trainer = SFTTrainer(model=model, args=HFTrainingArguments(output_dir=f"{sys.argv[1]}/trainer", use_cpu=True,
                                                           report_to="none"))
with torch.no_grad():
    model.model.layers[0].mlp.experts.gate_up_proj.mul_(1.5)  # as an optimizer step would
try:
    trainer.save_model(f"{sys.argv[1]}/saved")
    report["save_error"] = None
except RuntimeError as e:
    report["save_error"] = str(e)
dist.barrier()
if rank == 0 and report["save_error"] is None:
    saved = MixtralForCausalLM.from_pretrained(f"{sys.argv[1]}/saved", dtype=torch.float32)
    report["saved_all_experts"] = bool(torch.equal(saved.model.layers[0].mlp.experts.gate_up_proj, expected))

with open(f"{sys.argv[1]}/rank{rank}.json", "w") as fh:
    json.dump(report, fh)
dist.barrier()
dist.destroy_process_group()
