"""Expert parallelism for transformers' fused MoE blocks (Mixtral-style: `gate` router + `experts` with 3-D
`gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I), top-k weights renormalised by the router).

Each of the N ranks holds E/N experts and a replica of the router; tokens go to their experts' ranks and back by
`all_to_all_single` (autograd through torch.distributed.nn.functional). Hand-written because transformers' `ep_plan`
needs its tensor-parallel loading path and DeepSpeed's MoE layer is not the native block; this one keeps the native
parameter names, so the model still saves as the native class (the experts are gathered for saving).

Capacity: with `capacity_factor` c, each source rank keeps at most ceil(c * tokens * k / E) assignments per expert
(first come, first kept, in token order); a dropped assignment contributes nothing, and counting on the source rank
makes the output independent of N. `last_dropped` holds the assignments the last forward dropped.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

from .blocks import moe_blocks, router_of


class ExpertParallelMoE(nn.Module):
    """Replaces a native sparse MoE block; `gate` is the block's own router module, `experts` holds the local slice."""

    def __init__(self, block: nn.Module, group=None, capacity_factor: float | None = None):
        super().__init__()
        self.group = group
        self.ep_size = dist.get_world_size(group) if group is not None else 1
        self.ep_rank = dist.get_rank(group) if group is not None else 0
        experts = block.experts
        e = experts.gate_up_proj.shape[0]
        if e % self.ep_size:
            raise ValueError(f"moe.expert_parallel_size: {self.ep_size} does not divide the {e} experts")
        self.num_experts, self.local = e, e // self.ep_size
        self.capacity_factor = capacity_factor
        self.gate = router_of(block)  # the native router: same routing, and router hooks keep working
        lo, hi = self.ep_rank * self.local, (self.ep_rank + 1) * self.local
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[lo:hi].clone())
        self.experts.down_proj = nn.Parameter(experts.down_proj.detach()[lo:hi].clone())
        self.act_fn = experts.act_fn
        self.jitter_noise = getattr(block, "jitter_noise", 0.0)
        self.last_dropped = 0
        self._full: dict[str, torch.Tensor] | None = None  # gathered experts for saving (see gather_for_save)
        self._full_versions: tuple | None = None
        self._register_state_dict_hook(ExpertParallelMoE._full_state_dict)
        self._register_load_state_dict_pre_hook(self._slice_on_load)

    # -- forward ---------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, t, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        if self.training and self.jitter_noise > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        _, weights, experts = self.gate(x)  # (T, k) renormalised top-k weights and expert ids
        k = experts.shape[1]
        flat_e = experts.reshape(-1)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)
        order = torch.argsort(flat_e, stable=True)  # by expert, then token order: grouped by destination rank
        e_sorted = flat_e[order]
        counts = torch.bincount(e_sorted, minlength=self.num_experts)
        if self.capacity_factor:
            cap = math.ceil(self.capacity_factor * x.shape[0] * k / self.num_experts)
            starts = torch.cumsum(counts, 0) - counts
            pos = torch.arange(e_sorted.numel(), device=x.device) - starts[e_sorted]
            keep = pos < cap
            order, e_sorted = order[keep], e_sorted[keep]
            counts = torch.bincount(e_sorted, minlength=self.num_experts)
            self.last_dropped = int((~keep).sum())
        else:
            self.last_dropped = 0
        send = x[token[order]]
        send_splits = counts.view(self.ep_size, self.local).sum(1)
        if self.ep_size > 1:
            recv_splits = torch.empty_like(send_splits)
            dist.all_to_all_single(recv_splits, send_splits, group=self.group)
            s, r = send_splits.tolist(), recv_splits.tolist()
            recv_e = torch.empty(sum(r), dtype=e_sorted.dtype, device=x.device)
            dist.all_to_all_single(recv_e, e_sorted, r, s, group=self.group)
            recv = _all_to_all(send, r, s, self.group)
        else:
            recv, recv_e = send, e_sorted
        out = torch.zeros_like(recv)
        local_e = recv_e - self.ep_rank * self.local
        gate_up_proj, down_proj = (scale_grad(p, 1.0 / self.ep_size) if self.ep_size > 1 else p
                                   for p in (self.experts.gate_up_proj, self.experts.down_proj))
        for i in range(self.local):
            idx = (local_e == i).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            # in the activations' dtype: FSDP's mixed precision casts the sharded part only, not these
            gate, up = F.linear(recv[idx], gate_up_proj[i].to(recv.dtype)).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, down_proj[i].to(recv.dtype))
            out = out.index_copy(0, idx, y.to(out.dtype))
        back = _all_to_all(out, s, r, self.group) if self.ep_size > 1 else out
        w = weights.reshape(-1)[order].unsqueeze(1).to(back.dtype)
        result = torch.zeros_like(x).index_add(0, token[order], back * w)
        return result.reshape(b, t, h)

    # -- saving: the native layout ---------------------------------------------------------------------------
    @torch.no_grad()
    def gather_for_save(self) -> None:
        """Collective (every rank of the group): the full (E, ...) expert tensors, kept for the next state_dict."""
        full = {}
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(self.experts, name).detach()
            if self.ep_size == 1:
                full[name] = p.clone()
                continue
            out = torch.empty((self.ep_size * p.shape[0], *p.shape[1:]), dtype=p.dtype, device=p.device)
            dist.all_gather_into_tensor(out, p.contiguous(), group=self.group)
            full[name] = out
        self._full = full
        self._full_versions = self._versions()

    def _versions(self):
        return (self.experts.gate_up_proj._version, self.experts.down_proj._version)

    @staticmethod
    def _full_state_dict(module, state_dict, prefix, local_metadata):
        if module.ep_size > 1:
            if module._full is None or module._full_versions != module._versions():
                raise RuntimeError("expert-parallel weights changed since the last gather: call "
                                   "expert_parallel.gather_for_save(model) on every rank before state_dict()")
            for name, t in module._full.items():
                state_dict[f"{prefix}experts.{name}"] = t
        return state_dict

    def _slice_on_load(self, state_dict, prefix, *args):
        lo, hi = self.ep_rank * self.local, (self.ep_rank + 1) * self.local
        for name in ("gate_up_proj", "down_proj"):
            key = f"{prefix}experts.{name}"
            if key in state_dict and state_dict[key].shape[0] == self.num_experts != self.local:
                state_dict[key] = state_dict[key][lo:hi]


class ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times `scale` backward: the expert weights as the layer's forward uses them. Part of
    the forward path, so the scaling holds for whatever Parameter objects the layer holds at that moment (a hook on
    the Parameters would be lost to anything that re-creates them: loading to empty tensors, FSDP's preparation)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_grad(weight: torch.Tensor, scale: float) -> torch.Tensor:
    return ScaleGrad.apply(weight, scale)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single with autograd: the backward sends the gradients back the way the tokens came."""
    out = x.new_empty((sum(out_splits), x.shape[1]))
    return all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)


def parallel_blocks(model: nn.Module) -> list[ExpertParallelMoE]:
    """The blocks whose experts are split over more than one rank (a capacity factor alone splits nothing)."""
    return [m for m in model.modules() if isinstance(m, ExpertParallelMoE) and m.ep_size > 1]


def expert_parallel_size(model: nn.Module) -> int:
    blocks = parallel_blocks(model)
    return blocks[0].ep_size if blocks else 1


def local_experts(model: nn.Module) -> dict[str, nn.Parameter]:
    """This rank's expert slices by their names in `model` (they differ from rank to rank)."""
    mine = {id(p) for b in parallel_blocks(model) for p in (b.experts.gate_up_proj, b.experts.down_proj)}
    return {n: p for n, p in model.named_parameters() if id(p) in mine}


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, experts: list[nn.Parameter], group) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over every rank's parameters: the dense gradients are the same on every rank
    (DDP averaged them), each rank's `experts` are its own, so their squares are summed over the expert-parallel
    `group`. Every rank gets the same norm and scales by the same factor (a rank-local norm would clip ranks
    differently and the replicated weights would drift apart). Returns the norm before clipping."""
    mine = {id(p) for p in experts}
    with_grad = [p for p in model.parameters() if p.grad is not None]
    if not with_grad:
        return torch.zeros(())
    # [0]: gradients every rank holds alike (DDP's dense ones); [1]: each rank's own part (its experts, and FSDP's
    # shards of the dense ones), summed over the ranks
    squares = torch.zeros(2, dtype=torch.float32, device=_local(with_grad[0].grad).device)
    for p in with_grad:
        own = id(p) in mine or isinstance(p.grad, DTensor)
        squares[int(own)] += torch.linalg.vector_norm(_local(p.grad).float()).square()
    own_squares = squares[1:].clone()
    dist.all_reduce(own_squares, group=group)
    total = (squares[0] + own_squares[0]).sqrt()
    if math.isfinite(max_norm):
        scale = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))  # as torch's clip_grad_norm_
        for p in with_grad:
            p.grad.mul_(scale)
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def expert_param_names(model: nn.Module) -> list[str]:
    return [f"{n}.experts.{p}" for n, m in model.named_modules() if isinstance(m, ExpertParallelMoE)
            for p in ("gate_up_proj", "down_proj")]


def parallelize(model: nn.Module, group=None, capacity_factor: float | None = None) -> int:
    """Swap every native sparse MoE block of `model` for an ExpertParallelMoE over `group` (None: local experts,
    e.g. for a capacity factor without parallelism); returns how many were swapped.

    The expert parameters differ between ranks, so DDP skips them (`_ddp_params_and_buffers_to_ignore`) and the
    layer's forward divides their gradients by the world size (ScaleGrad): the backward all_to_all already sums every
    rank's tokens, and the loss is scaled by the data-parallel size for DDP's mean to cancel (losses.normalise)."""
    blocks = {id(b) for b in moe_blocks(model) if not isinstance(b, ExpertParallelMoE)}
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in blocks:
                check_reproducible(child)
                setattr(parent, name, ExpertParallelMoE(child, group, capacity_factor))
                swapped += 1
    model._ddp_params_and_buffers_to_ignore = expert_param_names(model)
    return swapped


def check_reproducible(block: nn.Module) -> None:
    """Refuse a block this layer would not compute as the family does (its forward is the router's top-k weights
    times fused experts, nothing else): gpt-oss's experts have biases and a clamp; Qwen2-MoE's block adds a shared
    expert, DeepSeek-V3's and GLM-4.5's shared experts, and their routers choose by sigmoid score plus a bias within
    groups of experts and scale the weights (tests/test_moe.py checks each family: refused, or the same logits)."""
    name, router = type(block).__name__, router_of(block)
    if (not hasattr(block.experts, "gate_up_proj") or hasattr(block.experts, "gate_up_proj_bias")
            or not hasattr(router, "top_k")):
        raise ValueError(f"moe.expert_parallel_size: {name} is not a fused Mixtral-style block (gate_up_proj / "
                         "down_proj experts without biases and a top-k router)")
    if hasattr(block, "shared_expert") or hasattr(block, "shared_experts"):
        raise ValueError(f"moe.expert_parallel_size: {name} has a shared expert, which this layer does not run; "
                         "expert parallelism supports Mixtral-style blocks")
    if hasattr(router, "e_score_correction_bias") or hasattr(block, "e_score_correction_bias"):
        raise ValueError(f"moe.expert_parallel_size: {name} routes by score plus a bias within groups of experts, "
                         "which this layer does not run; expert parallelism supports Mixtral-style blocks")


def gather_for_save(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, ExpertParallelMoE):
            m.gather_for_save()


def release_gathered(model: nn.Module) -> None:
    """Drop the gathered copies of every expert (gather_for_save) once what needed them has read them."""
    for m in model.modules():
        if isinstance(m, ExpertParallelMoE):
            m._full = m._full_versions = None


class ExpertParallelCallback(TrainerCallback):
    """Drops the gathered copies of the experts while training (a copy of every expert on every rank is what expert
    parallelism saves): once accelerate's preparation and a resume's load have read them, and after each checkpoint.
    The gather itself is part of every save (mixin.MoeMixin.save_model)."""

    def __init__(self, model):
        self.model = model

    def on_train_begin(self, args, state, control, **kwargs):
        release_gathered(self.model)

    def on_save(self, args, state, control, **kwargs):
        release_gathered(self.model)
