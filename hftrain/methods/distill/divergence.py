"""The divergence between the student's and the teacher's next-token distributions, per completion token, computed
in chunks of tokens: at most one chunk's log-softmaxes (student's and teacher's, [chunk, vocab] each) exist at a
time, in the forward and, through activation checkpointing of each chunk, in the backward (which recomputes them
chunk by chunk). The loss is their sum; trainer.py divides it by the global completion-token count.

    forward_kl  KL(teacher || student) = sum_v t_v (log t_v - log s_v)
    reverse_kl  KL(student || teacher) = sum_v s_v (log s_v - log t_v)
    jsd         beta KL(teacher || m) + (1 - beta) KL(student || m),  m = beta t + (1 - beta) s

with s = softmax(student logits / temperature), t = softmax(teacher logits / temperature); jsd is GKD's generalised
Jensen-Shannon divergence (forward_kl at beta 0, reverse_kl at beta 1). With top_k both distributions are
renormalised over the teacher's k most likely tokens of each position (all three stay finite there).

Why by hand: TRL 1.16's experimental GKDTrainer.generalized_jsd_loss takes whole [batch, sequence, vocab] logits and
builds both full log-softmaxes (and a stacked mixture) at once, and averages per micro-batch unless handed a count;
it has no top-k. hftrain needs the sum over the completion tokens, chunked, for its exact global-batch mean
(losses.GlobalBatchMixin); the formula is the same (tests/test_distill_divergence.py checks it against torch's
kl_div, chunked against unchunked, values and gradients)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ...losses.chunked_ce import chunk_rows

KINDS = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class DivergenceSpec:
    kind: str  # forward_kl, reverse_kl, jsd
    beta: float = 0.5  # jsd: the teacher's weight in the mixture
    temperature: float = 1.0
    top_k: int | None = None


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row from log-probabilities."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def chunk_divergence(student: torch.Tensor, teacher: torch.Tensor, spec: DivergenceSpec) -> torch.Tensor:
    """The divergence of each row of `student` / `teacher` ([rows, vocab] logits), in fp32: [rows]."""
    s, t = student.float() / spec.temperature, teacher.float() / spec.temperature
    if spec.top_k is not None and spec.top_k < t.shape[-1]:
        keep = t.topk(spec.top_k, dim=-1).indices
        s, t = s.gather(-1, keep), t.gather(-1, keep)
    log_s, log_t = F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1)
    if spec.kind == "forward_kl":
        return _kl(log_t, log_s)
    if spec.kind == "reverse_kl":
        return _kl(log_s, log_t)
    if spec.kind != "jsd":
        raise ValueError(f"divergence {spec.kind!r} is not one of {', '.join(KINDS)}")
    mixture = torch.logaddexp(log_t + math.log(spec.beta), log_s + math.log1p(-spec.beta))
    return spec.beta * _kl(log_t, mixture) + (1 - spec.beta) * _kl(log_s, mixture)


def token_divergences(student: torch.Tensor, teacher: torch.Tensor, spec: DivergenceSpec,
                      chunk_size: int | None = None) -> torch.Tensor:
    """The divergence of every row ([rows, vocab] logits of the completion tokens; the teacher's carry no gradient),
    chunk by chunk: each chunk checkpointed when a gradient is needed, so that its log-softmaxes are recomputed in the
    backward instead of kept. `chunk_size`: rows per chunk (default: losses.chunked_ce's, by vocabulary)."""
    rows = student.shape[0]
    if rows == 0:
        return student.new_zeros(0, dtype=torch.float32) + 0 * student.sum()
    size = chunk_size or chunk_rows(student.shape[-1])
    teacher = teacher.detach()
    parts = []
    for start in range(0, rows, size):
        s, t = student[start:start + size], teacher[start:start + size]
        if s.requires_grad:
            parts.append(checkpoint(chunk_divergence, s, t, spec, use_reentrant=False))
        else:
            parts.append(chunk_divergence(s, t, spec))
    return torch.cat(parts)


def divergence_sum(student: torch.Tensor, teacher: torch.Tensor, spec: DivergenceSpec,
                   chunk_size: int | None = None) -> torch.Tensor:
    """The sum of `token_divergences`: a micro-batch's loss before the global count divides it."""
    return token_divergences(student, teacher, spec, chunk_size).sum()
