"""2-rank check of hftrain.moe.expert_parallel (run by tests/test_moe.py with torchrun): the expert-parallel layer's
output and gradients equal the native Mixtral block's / the local layer's on the same input."""

import json
import sys

import torch
import torch.distributed as dist
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

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
        # a local expert's gradient sums every rank's tokens routed to it
        "grad_gate_up": float((ep.experts.gate_up_proj.grad - ref_experts.gate_up_proj.grad[lo:hi]).abs().max()),
        "grad_down": float((ep.experts.down_proj.grad - ref_experts.down_proj.grad[lo:hi]).abs().max()),
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

with open(f"{sys.argv[1]}/rank{rank}.json", "w") as fh:
    json.dump(report, fh)
dist.barrier()
dist.destroy_process_group()
