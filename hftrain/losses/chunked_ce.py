"""Chunked linear cross-entropy: each token's CE from the final hidden states and the output projection, without the
full logits.

`linear_ce(hidden [N, H], weight [V, H], bias, targets [N])` returns the same per-position CE as
`losses.target_ce(logits)` (0 where the target is ignored), but only rows with a target are projected, and at most
`chunk_size` of them at a time: forward keeps the CE of each row and nothing of its logits; backward recomputes each
chunk's logits and differentiates them with autograd (the same ops as the logits path, so the same numbers), adding
the chunk's weight gradient into one buffer. With `row_weights` (what the training loss uses: losses.hidden_loss_sum)
it returns sum(row_weights * CE) and computes the gradients in forward, while each chunk's logits exist: no
recomputation. Peak extra memory: a few chunk x vocabulary tensors instead of tokens x vocabulary (fp32 logits, their
log-softmax and their gradient).

`HeadMath` is what a model does to `lm_head`'s output before returning it (Gemma's final soft-cap, Cohere's logit
scale, Granite's logits scaling); `head_of(model)` finds the head and that maths, or says why it cannot;
`capture_hidden(head)` makes the head return a placeholder and keep its input, so that the wrapped model's forward
(DDP's, with its gradient hooks) runs as usual without computing logits. The loss normalisation stays in losses.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import torch
import torch.nn.functional as F

from ..constants import IGNORE_INDEX

CHUNK_BYTES = 64 * 2**20  # fp32 logits per chunk: 128 target tokens at a 131k vocabulary, 512 at 32k


@dataclasses.dataclass(frozen=True)
class HeadMath:
    """logits = softcap(lm_head(h) * scale / divide), each step only where set, in the model's own order."""

    scale: float | None = None  # Cohere: logits * logit_scale
    divide: float | None = None  # Granite: logits / logits_scaling
    softcap: float | None = None  # Gemma 2/3: cap * tanh(logits / cap)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            logits = logits * self.scale
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _chunk_ce(h, weight, bias, targets, math: HeadMath, label_smoothing: float) -> torch.Tensor:
    # The ops of the logits path: the head in the model's dtype, its post-processing, then CE in fp32.
    logits = math.apply(F.linear(h, weight, bias)).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none",
                           label_smoothing=label_smoothing)


def _chunks(hidden, weight, bias, targets, math, label_smoothing, chunk_size, upstream, needs):
    """Each row's CE and, where `needs` (hidden, weight, bias), the gradients of sum(upstream * CE), one chunk's
    logits at a time: autograd differentiates the chunk's own ops, so the numbers are the logits path's."""
    need_h, need_w, need_b = needs
    ce = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    grad_h = torch.empty_like(hidden) if need_h else None
    # fp32 accumulators across chunks (the logits path accumulates its one matmul in fp32 too)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
    w = weight.detach().requires_grad_(need_w)
    b = bias.detach().requires_grad_(need_b) if bias is not None else None
    for s in range(0, hidden.shape[0], chunk_size):
        e = s + chunk_size
        h = hidden[s:e].detach().requires_grad_(need_h)
        wanted = [x for x, need in ((h, need_h), (w, need_w), (b, need_b)) if need]
        with torch.set_grad_enabled(bool(wanted)):
            c = _chunk_ce(h, w, b, targets[s:e], math, label_smoothing)
            grads = list(torch.autograd.grad(c, wanted, upstream[s:e])) if wanted else []
        ce[s:e] = c.detach()
        if need_h:
            grad_h[s:e] = grads.pop(0)
        if need_w:
            grad_w += grads.pop(0)
        if need_b:
            grad_b += grads.pop(0)
    return (ce, grad_h, grad_w.to(weight.dtype) if need_w else None, grad_b.to(bias.dtype) if need_b else None)


class _LinearCE(torch.autograd.Function):
    """(N,) per-row CE; backward recomputes each chunk's logits (4 head matmuls per chunk: the logits path's 3 + 1)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, math, label_smoothing, chunk_size):
        ce = _chunks(hidden, weight, bias, targets, math, label_smoothing, chunk_size, None, (False,) * 3)[0]
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.math, ctx.label_smoothing, ctx.chunk_size = math, label_smoothing, chunk_size
        ctx.autocast = autocast_state(hidden.device.type)  # backward recomputes under the same autocast
        return ce

    @staticmethod
    def backward(ctx, grad_ce):
        hidden, weight, bias, targets = ctx.saved_tensors
        with torch.autocast(*ctx.autocast):
            _, gh, gw, gb = _chunks(hidden, weight, bias, targets, ctx.math, ctx.label_smoothing, ctx.chunk_size,
                                    grad_ce, ctx.needs_input_grad[:3])
        return gh, gw, gb, None, None, None, None


def _fused_chunk(h, weight, bias, targets, row_weights, math: HeadMath, label_smoothing: float, needs):
    """The chunk's CE and the gradients of sum(row_weights * CE) by hand (every target valid): the logits path's
    forward ops, then softmax - smoothed one-hot through the head's maths, in place on one chunk x vocabulary
    buffer (autograd would keep the log-softmax, its gradient and the one-hot's scatter besides)."""
    z = F.linear(h, weight, bias)
    y, dtype = math.apply(z).float(), z.dtype  # y may be z itself (fp32, no maths)
    del z  # at most two chunk x vocabulary buffers from here: y (while the soft-cap needs it) and logp
    logp = torch.log_softmax(y, dim=-1)  # as F.cross_entropy computes it
    ce = -logp.gather(1, targets[:, None]).squeeze(1)
    if label_smoothing:  # torch's: (1 - e) * nll + e * mean over classes of -log p
        ce = (1 - label_smoothing) * ce - label_smoothing * logp.mean(dim=-1)
    if not any(needs):
        return ce, None, None, None
    if math.softcap is None:
        del y
    g = logp.exp_()  # softmax, in place
    if label_smoothing:
        g.sub_(label_smoothing / g.shape[-1])
    g[torch.arange(g.shape[0], device=g.device), targets] -= 1 - label_smoothing
    g.mul_(row_weights[:, None])
    if math.softcap is not None:  # d(cap * tanh(x / cap))/dx = 1 - (y / cap)^2
        g.mul_(y.div_(math.softcap).square_().neg_().add_(1))
        del y
    if math.divide is not None:
        g.div_(math.divide)
    if math.scale is not None:
        g.mul_(math.scale)
    g = g.to(dtype)
    grad_h = g @ weight if needs[0] else None
    grad_w = g.t() @ h if needs[1] else None
    grad_b = g.sum(dim=0) if needs[2] else None
    return ce, grad_h, grad_w, grad_b


class _LinearCESum(torch.autograd.Function):
    """sum(row_weights * CE) with the gradients computed in forward, while each chunk's logits exist (Liger's
    fused linear cross-entropy does the same): 3 head matmuls per chunk, as the logits path; backward only scales
    them. The row weights (1 per target token, 1/length per sequence) are known before the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_weights, math, label_smoothing, chunk_size):
        needs = ctx.needs_input_grad[:3]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if needs[0] else None
        # fp32 accumulators across chunks (the logits path accumulates its one matmul in fp32 too)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs[2] else None
        for s in range(0, hidden.shape[0], chunk_size):
            e = s + chunk_size
            ce, gh, gw, gb = _fused_chunk(hidden[s:e], weight, bias, targets[s:e], row_weights[s:e], math,
                                          label_smoothing, needs)
            total += (ce * row_weights[s:e]).sum()
            if needs[0]:
                grad_h[s:e] = gh
            if needs[1]:
                grad_w += gw
            if needs[2]:
                grad_b += gb
        ctx.grads = (grad_h, grad_w.to(weight.dtype) if needs[1] else None,
                     grad_b.to(bias.dtype) if needs[2] else None)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grads = [None if g is None else g * grad_out.to(g.dtype) for g in ctx.grads]
        ctx.grads = None
        return *grads, None, None, None, None, None


def chunk_rows(vocab: int) -> int:
    """Rows per chunk: CHUNK_BYTES of fp32 logits (at least 16 rows)."""
    return max(16, CHUNK_BYTES // (4 * vocab))


def linear_ce(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
              math: HeadMath = HeadMath(), label_smoothing: float = 0.0, chunk_size: int | None = None,
              row_weights: torch.Tensor | None = None):
    """Without `row_weights`: (N,) fp32 CE of each row of `hidden` (N, H) against `targets` (N,), 0 where the target
    is IGNORE_INDEX. With `row_weights` (N,): the scalar sum(row_weights * CE), gradients computed in forward."""
    chunk_size = chunk_rows(weight.shape[0]) if chunk_size is None else chunk_size
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    keep = (targets != IGNORE_INDEX).nonzero().squeeze(1)  # rows without a target are never projected
    h, t = hidden.index_select(0, keep), targets.index_select(0, keep)
    if row_weights is not None:
        return _LinearCESum.apply(h, weight, bias, t, row_weights.float().index_select(0, keep), math,
                                  label_smoothing, chunk_size)
    ce = _LinearCE.apply(h, weight, bias, t, math, label_smoothing, chunk_size)
    return torch.zeros(targets.shape[0], dtype=ce.dtype, device=ce.device).index_copy(0, keep, ce)


# -- the model's head --------------------------------------------------------------------------------------------
# What causal LMs in transformers 5.23 do to lm_head's output besides the maths of HeadMath: a forward holding one of
# these is not reproduced (the logits path is used). Found by reading every modeling_*.py after `self.lm_head(`.
_UNSUPPORTED_MARKERS = ("logit_softcap(", "final_logits_bias", "unpadded_vocab_size", "predict_logits")


def head_of(model) -> tuple[torch.nn.Module | None, HeadMath | None, str]:
    """(lm_head, its maths, "") for a causal LM whose logits chunked_ce reproduces, else (None, None, why not)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the transformers model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:  # noqa: E721 - a LoRA, quantised or custom head computes something else
        return None, None, f"its output head is a {type(head).__name__}, not a plain torch.nn.Linear"
    if (getattr(base, "tp_size", None) or 1) > 1:  # its weight a DTensor, each rank's a slice of the vocabulary
        return None, None, "lm_head is split over the tensor-parallel ranks (strategy.tp_size)"
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return None, None, f"the source of {type(base).__name__}.forward cannot be read to check its head"
    if "self.lm_head(" not in source or base.get_output_embeddings() is not getattr(base, "lm_head", None):
        return None, None, f"{type(base).__name__}.forward does not call self.lm_head"
    odd = [m for m in _UNSUPPORTED_MARKERS if m in source]
    if odd:
        return None, None, f"{type(base).__name__}.forward post-processes its logits ({odd[0]})"
    config = base.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    math = HeadMath(
        scale=float(base.logit_scale) if "* self.logit_scale" in source else None,
        divide=float(text.logits_scaling) if "logits_scaling" in source else None,
        softcap=getattr(text, "final_logit_softcapping", None) if "final_logit_softcapping" in source else None,
    )
    return head, math, ""


def autocast_state(device_type: str) -> tuple[str, torch.dtype, bool]:
    """torch.autocast's arguments for the autocast in force now on `device_type`."""
    return device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type)


@dataclasses.dataclass
class Captured:
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    loss: torch.Tensor | None = None  # what capture_hidden's `loss_fn` returned


class _Placeholder(torch.autograd.Function):
    """lm_head's output instead of logits: zeros of width 1 in the autograd graph (ZeRO-3's hooks on lm_head's
    output and input pair up in backward only if a gradient passes its output: SFTTrainer._ce (ChunkedLossMixin)
    adds 0 * its sum), passing no gradient to the hidden states."""

    @staticmethod
    def forward(ctx, h):
        return h.new_zeros(*h.shape[:-1], 1)

    @staticmethod
    def backward(ctx, grad):
        return None


@contextlib.contextmanager
def capture_hidden(head: torch.nn.Linear, loss_fn=None):
    """While open, `head(h)` keeps (h, weight, bias) in the yielded `Captured` and returns zeros of shape
    (*h.shape[:-1], 1) instead of logits (width 1, not 0: reshapes with -1 must still work on it). The model's own
    post-processing then runs on the placeholder, harmlessly. The weight is the parameter itself, so its gradient
    reaches it through the chunked loss (tied embeddings: the embedding's).

    `loss_fn(hidden, captured)` is computed inside the head's call (into `captured.loss`), where the head's weight is
    as its own forward sees it: gathered by ZeRO-3 and FSDP2, under the forward's autocast. In backward its gradient
    then reaches the weight after ZeRO-3 has gathered it again: ZeRO-3's hook on the head's output (which gathers) was
    created after the loss's autograd node and runs before it (the engine runs the newest ready node first), as for the
    head's own matmul. Computed after the head's call instead, the weight's gradient arrived while it was released
    (an untied head's gradient was then allocated at the released size and the backward failed)."""
    captured = Captured()

    def forward(h):
        captured.hidden, captured.weight, captured.bias = h, head.weight, head.bias
        if loss_fn is not None:
            captured.loss = loss_fn(h, captured)
        return _Placeholder.apply(h)

    head.forward = forward  # an instance attribute: nn.Module.__call__ (and its hooks) now run it
    try:
        yield captured
    finally:
        del head.forward
