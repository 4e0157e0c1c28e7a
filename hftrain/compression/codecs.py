"""The codecs of the compressed hooks, pure maths tested single-process: int8 with a scale per chunk, top-k selection,
and the bytes a ring collective sends."""

from __future__ import annotations

import math

import torch


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
