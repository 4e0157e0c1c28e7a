"""DDP communication hooks (fp16 and PowerSGD are PyTorch's; bf16, int8 and top-k written here: PyTorch's refuse gloo
or lack error feedback), each issuing one collective from the hook itself and returning the MEAN gradient; and the
wiring into accelerate's DDP kwargs (patches.accelerate.HookedDDPKwargs) and FSDP's reduce dtype."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from ..patches.accelerate import HookedDDPKwargs
from .codecs import dequantize_int8, quantize_int8, topk_select, wire_bytes
from .meter import CommMeter, timed


@dataclass
class HookState:
    method: str
    world: int
    start_step: int = 0
    error_feedback: bool = True
    topk_ratio: float = 0.01
    int8_chunk: int = 2048
    meter: CommMeter = field(default_factory=CommMeter)
    group: object = None
    iter: int = 0  # optimizer steps seen (bucket.is_last() ends one, as in PyTorch's PowerSGD state)
    residuals: dict = field(default_factory=dict)  # bucket index -> local error not yet sent
    powersgd: object = None  # PyTorch's PowerSGDState for method "powersgd"

    def residual(self, index: int, like: torch.Tensor) -> torch.Tensor:
        r = self.residuals.get(index)
        if r is None or r.numel() != like.numel():  # first use, or DDP rebuilt its buckets after step 0
            r = torch.zeros_like(like)
            self.residuals[index] = r
        return r


def _raw(bucket) -> int:
    buf = bucket.buffer()
    return buf.numel() * buf.element_size()


def _allreduce_mean(state: HookState, bucket, dtype: torch.dtype | None) -> torch.futures.Future:
    """fp32 (dtype None) or a 16-bit all-reduce of the bucket, divided by the world size before summing."""
    buf = bucket.buffer()
    send = (buf if dtype is None else buf.to(dtype)).div_(state.world)  # buf.to(dtype) is a copy
    fut = dist.all_reduce(send, group=state.group, async_op=True).get_future()

    def decompress(f):
        if dtype is not None:
            buf.copy_(f.value()[0])
        return buf

    sent = wire_bytes("all_reduce", send.numel() * send.element_size(), state.world)
    return timed(state.meter, fut.then(decompress), wire_bytes("all_reduce", _raw(bucket), state.world), sent)


def _gather_mean(state: HookState, bucket, payload: torch.Tensor, decode) -> torch.futures.Future:
    """All-gather each rank's uint8 payload once; the mean of the decoded tensors becomes the bucket's gradient."""
    buf = bucket.buffer()
    pad = -payload.numel() % 4  # every rank's row starts 4-byte aligned, so its fields can be viewed in place
    if pad:
        payload = torch.cat([payload, payload.new_zeros(pad)])
    out = torch.empty(state.world * payload.numel(), dtype=torch.uint8, device=payload.device)
    fut = dist.all_gather_single(out, payload, group=state.group, async_op=True).get_future()

    def decompress(f):
        rows = out.view(state.world, -1)
        total = torch.zeros(buf.numel(), dtype=torch.float32, device=buf.device)
        for r in range(state.world):
            total += decode(rows[r])
        buf.copy_(total.div_(state.world).view_as(buf))
        return buf

    sent = wire_bytes("all_gather", payload.numel(), state.world)
    return timed(state.meter, fut.then(decompress), wire_bytes("all_reduce", _raw(bucket), state.world), sent)


def _with_feedback(state: HookState, bucket) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The bucket plus the error carried from the last step (flat float32), and the residual slot to update."""
    x = bucket.buffer().detach().float()
    if not state.error_feedback:
        return x, None
    r = state.residual(bucket.index(), x)
    return x + r, r


def int8_hook(state: HookState, bucket) -> torch.futures.Future:
    x, r = _with_feedback(state, bucket)
    q, scales = quantize_int8(x, state.int8_chunk)
    if r is not None:
        r.copy_(x - dequantize_int8(q, scales, state.int8_chunk))  # exactly what this rank did not send
    n, c = q.numel(), 4 * scales.numel()
    payload = torch.cat([scales.view(torch.uint8), q.view(torch.uint8)])  # 4-byte fields first: aligned views

    def decode(row):
        return dequantize_int8(row[c:c + n].view(torch.int8), row[:c].view(torch.float32), state.int8_chunk)

    return _gather_mean(state, bucket, payload, decode)


def topk_hook(state: HookState, bucket) -> torch.futures.Future:
    """The k largest magnitudes as (int32 index, bf16 value): 6 bytes per kept element instead of 4 per element,
    so a ratio r sends 1.5 r of the bytes. bf16's rounding is part of the error fed back, like everything unsent."""
    x, r = _with_feedback(state, bucket)
    idx, vals = topk_select(x, state.topk_ratio)
    vals = vals.to(torch.bfloat16)
    if r is not None:
        r.copy_(x)
        r[idx.long()] -= vals.float()  # what was sent leaves the residual; its rounding error stays
    k = idx.numel()
    payload = torch.cat([idx.view(torch.uint8), vals.view(torch.uint8)])

    def decode(row):
        dense = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
        dense[row[: 4 * k].view(torch.int32).long()] = row[4 * k:6 * k].view(torch.bfloat16).float()
        return dense

    return _gather_mean(state, bucket, payload, decode)


def _powersgd_hook(state: HookState, bucket) -> torch.futures.Future:
    """PyTorch's PowerSGD; its own element counters say how much it sent (all of it in all-reduces).

    Its P and Q all-reduces come from future callbacks, which on gloo run on gloo's thread and can interleave with
    the next bucket's all-reduce in a different order on each rank (gloo aborts): on gloo the chain is waited for
    inside the hook (same maths, no overlap with backward)."""
    ps = state.powersgd
    start = time.perf_counter()
    before = ps.total_numel_after_compression
    fut = powerSGD_hook.powerSGD_hook(ps, bucket)
    if dist.get_backend(state.group) == "gloo":
        done = torch.futures.Future()
        done.set_result(fut.wait())
        fut = done
    elements = ps.total_numel_after_compression - before  # 0 while it still runs vanilla all-reduce
    size = bucket.buffer().element_size()
    sent = elements * size if elements else _raw(bucket)
    return timed(state.meter, fut, wire_bytes("all_reduce", _raw(bucket), state.world),
                  wire_bytes("all_reduce", sent, state.world), start)


def _fp16_hook(state: HookState, bucket) -> torch.futures.Future:
    buf = bucket.buffer()
    raw = wire_bytes("all_reduce", _raw(bucket), state.world)
    return timed(state.meter, default_hooks.fp16_compress_hook(state.group, bucket), raw,
                  wire_bytes("all_reduce", buf.numel() * 2, state.world))


def ddp_hook(state: HookState, bucket):  # no annotations: DDP checks them, and they are strings here
    """The hook registered on DDP: uncompressed before `start_step`, then the method's. Method "none" (with
    compression.profile) is the plain mean all-reduce of DDP's own reducer, timed."""
    method = state.method
    entered = time.perf_counter()
    if method == "powersgd":
        fut = _powersgd_hook(state, bucket)  # PowerSGD keeps its own step count and warm-up
    elif method == "none" or state.iter < state.start_step:
        fut = _allreduce_mean(state, bucket, None)
    elif method == "fp16":
        fut = _fp16_hook(state, bucket)
    elif method == "bf16":
        fut = _allreduce_mean(state, bucket, torch.bfloat16)
    elif method == "int8":
        fut = int8_hook(state, bucket)
    elif method == "topk":
        fut = topk_hook(state, bucket)
    else:
        raise ValueError(method)
    state.meter.hook_call(entered, time.perf_counter(), bucket.is_last())
    if bucket.is_last():
        state.iter += 1
    return fut


def make_hook_state(cfg, world: int) -> HookState:
    """HookState from a CompressionSection (config.sections), its unset options resolved."""
    granularity, chunk = cfg.resolved_int8()
    state = HookState(method=cfg.method, world=world, start_step=cfg.resolved_start_step(),
                      error_feedback=cfg.resolved_error_feedback(), topk_ratio=cfg.resolved_topk_ratio(),
                      int8_chunk=chunk if granularity == "chunk" else 0)
    if cfg.method == "powersgd":
        state.powersgd = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=cfg.resolved_powersgd_rank(),
            start_powerSGD_iter=state.start_step, use_error_feedback=state.error_feedback, warm_start=True,
        )
    return state


def fsdp_reduce_dtype(cfg) -> torch.dtype | None:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.reduce_dtype())


def ddp_kwargs_with_hook(ddp_kwargs, cfg, on_register):
    """The Trainer's DistributedDataParallelKwargs (every DDP option kept) registering hftrain's hook instead
    (patches.accelerate.HookedDDPKwargs says why); install the result as `accelerator.ddp_handler`."""
    return HookedDDPKwargs(ddp_kwargs, lambda: make_hook_state(cfg, dist.get_world_size()), ddp_hook, on_register)
