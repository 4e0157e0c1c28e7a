"""Gradient compression on the data-parallel gradient reduction, and what it costs and saves.

DDP: a communication hook (fp16 and PowerSGD are PyTorch's; bf16, int8 and top-k are written here because PyTorch's
refuse gloo or lack error feedback). FSDP2 and ZeRO: fp16/bf16 as their reduce dtype (config.rules refuses the rest).
Each hook here issues one collective, from the hook itself (one issued from a future callback can race DDP's own),
and returns the MEAN gradient, which hftrain's loss normalisation (losses.py) assumes.

Bytes on the wire per rank (ring): all-reduce of B bytes 2(W-1)/W * B, all-gather of B bytes per rank (W-1) * B.
int8 and top-k are all-gathered (their sum has no compressed form), so their saving shrinks as W grows.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from transformers import TrainerCallback

from .patches.accelerate import HookedDDPKwargs


# -- pure maths (tested single-process) -------------------------------------------------------------------------
def quantize_int8(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one float32 scale per `chunk` elements (chunk <= 0: one scale for the tensor).
    |x - dequantize(q, s)| <= s / 2 elementwise, s = max|x| of the chunk / 127."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    size = n if chunk <= 0 else chunk
    pad = (-n) % size if n else 0
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, size) if n else flat.view(0, 1)
    scales = blocks.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(-1)[:n], scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, chunk: int) -> torch.Tensor:
    n = q.numel()
    size = n if chunk <= 0 else chunk
    pad = (-n) % size if n else 0
    blocks = torch.nn.functional.pad(q.float(), (0, pad)).view(-1, size) if n else q.float().view(0, 1)
    return (blocks * scales[:, None]).reshape(-1)[:n]


def topk_select(x: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (int32) and values of the ceil(ratio * n) largest magnitudes of a flat tensor."""
    k = max(1, math.ceil(ratio * x.numel()))
    idx = torch.topk(x.abs(), k, sorted=False).indices
    return idx.to(torch.int32), x[idx]


def wire_bytes(kind: str, payload_bytes: int, world: int) -> float:
    """Bytes one rank sends for a collective over `payload_bytes` (its own contribution), ring algorithms."""
    if world <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (world - 1) / world * payload_bytes
    if kind == "all_gather":
        return (world - 1) * payload_bytes
    raise ValueError(kind)


# -- measurement -------------------------------------------------------------------------------------------------
def merge(intervals) -> list[tuple[float, float]]:
    """The union of [start, end] intervals as sorted, disjoint intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals) -> float:
    return sum(b - a for a, b in merge(intervals))


def minus(intervals, holes) -> list[tuple[float, float]]:
    """The parts of `intervals` outside every interval of `holes`."""
    out = []
    holes = merge(holes)
    for a, b in merge(intervals):
        for h0, h1 in holes:
            if h1 <= a or h0 >= b:
                continue
            if h0 > a:
                out.append((a, h0))
            a = max(a, h1)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


class CommMeter:
    """Bytes and timing of the gradient collectives. Hooks call `record` (each collective's bytes and in-flight
    interval) and `hook_call` (the time the backward thread spent inside the hook); the callback reads `step_end`.

    Overlap: DDP calls the hook of a bucket as soon as its gradients are computed, so the call for the last bucket
    (`bucket.is_last()`) marks the end of the backward's compute. Communication is *hidden* while a collective is in
    flight before that mark and the backward thread is not itself waiting inside a hook (a hook that blocks, like
    PowerSGD's on gloo, stalls the backward: its communication hides nothing)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes_raw = 0.0
        self.bytes_sent = 0.0
        self._intervals: list[list[float]] = []
        self._in_hook: list[tuple[float, float]] = []
        self._backward_end: float | None = None

    def record(self, raw: float, sent: float, start: float | None = None) -> list[float]:
        """Count one bucket's bytes; returns the [start, end] interval that the caller closes on completion."""
        interval = [time.perf_counter() if start is None else start, math.inf]
        with self._lock:
            self.bytes_raw += raw
            self.bytes_sent += sent
            self._intervals.append(interval)
        return interval

    def close(self, interval: list[float]) -> None:
        interval[1] = time.perf_counter()

    def hook_call(self, start: float, end: float, last_bucket: bool) -> None:
        with self._lock:
            self._in_hook.append((start, end))
            if last_bucket:
                self._backward_end = start

    def step_end(self, step_start: float) -> dict:
        """This step's totals. time_share: the union of in-flight intervals over the step's wall time; seconds: that
        union; hidden_share: the part of it overlapped with the backward's compute (class docstring)."""
        now = time.perf_counter()
        with self._lock:
            raw, sent, intervals, in_hook, end = (self.bytes_raw, self.bytes_sent, self._intervals, self._in_hook,
                                                  self._backward_end)
            self.bytes_raw, self.bytes_sent, self._intervals, self._in_hook = 0.0, 0.0, [], []
            self._backward_end = None
        flight = merge((max(a, step_start), min(b, now)) for a, b in intervals)
        busy = length(flight)
        hidden = 0.0
        if end is not None:
            hidden = length(minus([(a, min(b, end)) for a, b in flight], in_hook))
        return {"bytes_raw": raw, "bytes_sent": sent, "time_share": busy / max(now - step_start, 1e-9),
                "seconds": busy, "hidden_share": hidden / busy if busy > 0 else 0.0}


def _timed(meter: CommMeter, fut: torch.futures.Future, raw: float, sent: float,
           start: float | None = None) -> torch.futures.Future:
    interval = meter.record(raw, sent, start)

    def done(f):
        meter.close(interval)
        return f.value()

    return fut.then(done)


# -- DDP hooks ---------------------------------------------------------------------------------------------------
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
    return _timed(state.meter, fut.then(decompress), wire_bytes("all_reduce", _raw(bucket), state.world), sent)


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
    return _timed(state.meter, fut.then(decompress), wire_bytes("all_reduce", _raw(bucket), state.world), sent)


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
    return _timed(state.meter, fut, wire_bytes("all_reduce", _raw(bucket), state.world),
                  wire_bytes("all_reduce", sent, state.world), start)


def _fp16_hook(state: HookState, bucket) -> torch.futures.Future:
    buf = bucket.buffer()
    raw = wire_bytes("all_reduce", _raw(bucket), state.world)
    return _timed(state.meter, default_hooks.fp16_compress_hook(state.group, bucket), raw,
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


# -- wiring into transformers' Trainer ---------------------------------------------------------------------------
def fsdp_reduce_dtype(cfg) -> torch.dtype | None:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.reduce_dtype())


def ddp_kwargs_with_hook(ddp_kwargs, cfg, on_register):
    """The Trainer's DistributedDataParallelKwargs (every DDP option kept) registering hftrain's hook instead
    (patches.accelerate.HookedDDPKwargs says why); install the result as `accelerator.ddp_handler`."""
    return HookedDDPKwargs(ddp_kwargs, lambda: make_hook_state(cfg, dist.get_world_size()), ddp_hook, on_register)


class CommMetricsCallback(TrainerCallback):
    """comm/bytes_raw, comm/bytes_sent, comm/compression_ratio, and under DDP comm/time_share, comm/seconds and
    comm/hidden_share (CommMeter), per optimizer step, averaged over the logging window. CommHookMixin.log merges
    `pop_logs()` into the Trainer's logs (trainer_state.json, TensorBoard).

    DDP: measured by the hook (bytes of the collectives it issued, time any of them was in flight). FSDP and ZeRO:
    the bytes their reduction is configured to send (reduce dtype vs the gradients' dtype); no time share."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.state: HookState | None = None  # set when DDP registers the hook
        self.static: tuple[float, float] | None = None  # (raw, sent) per step for FSDP / ZeRO
        self._t0 = 0.0
        self._steps: list[dict] = []

    def on_hook_registered(self, state: HookState) -> None:
        self.state = state

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.state is None and model is not None and args.world_size > 1 and self.cfg.method in ("fp16", "bf16"):
            params = [p for p in model.parameters() if p.requires_grad]
            n = sum(getattr(p, "ds_numel", p.numel()) for p in params)  # ZeRO-3 partitions hold ds_numel
            size = params[0].element_size() if params else 4
            # Reduce-scatter: (W-1)/W of the bytes, the same factor for both, so the ratio is the dtype ratio.
            w = args.world_size
            self.static = ((w - 1) / w * n * size, (w - 1) / w * n * 2)

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.state is not None:
            self._steps.append(self.state.meter.step_end(self._t0))
        elif self.static is not None:
            self._steps.append({"bytes_raw": self.static[0], "bytes_sent": self.static[1]})

    def pop_logs(self) -> dict:
        steps, self._steps = self._steps, []
        if not steps:
            return {}
        raw = sum(s["bytes_raw"] for s in steps)
        sent = sum(s["bytes_sent"] for s in steps)
        out = {"comm/bytes_raw": raw / len(steps), "comm/bytes_sent": sent / len(steps),
               "comm/compression_ratio": raw / sent if sent else float("nan")}
        for key in ("time_share", "seconds", "hidden_share"):  # DDP only: timed in the hook
            if key in steps[0]:
                out[f"comm/{key}"] = sum(s[key] for s in steps) / len(steps)
        return out
