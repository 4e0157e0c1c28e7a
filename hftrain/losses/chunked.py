"""The per-token cross-entropy a trainer's loss is built from: from the model's logits, or (training.loss_impl
chunked / auto) from lm_head's input in chunks, never materialising the full logits (chunked_ce.py holds the
maths, maths.py the sums), or (training.loss_impl: fused, asked for only) the training loss's sum from liger-kernel's
fused kernel (fused_ce.py). No labels reach the model, so no model-internal loss runs. The run says which in one line.
"""

from __future__ import annotations

import torch

from .. import distributed
from ..errors import ModelError
from . import chunked_ce, fused_ce
from . import maths as losses


class ChunkedLossMixin:
    """`self._head`: (lm_head, its maths) when the loss is chunked, else None; `self._fused`: the training loss's sum
    from liger-kernel's fused kernel (training.loss_impl: fused); `_forward` / `_ce` for the loss."""

    loss_chunk_size: int | None = None  # target tokens per chunk of the chunked loss (None: by vocabulary)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fused = False
        self._head = self._chunked_head(self.args.loss_impl)

    def _chunked_head(self, loss_impl: str):
        """training.loss_impl -> (lm_head, its maths) for the chunked loss, or None for the logits path; says which
        loss runs in one line."""
        if loss_impl == "logits":
            distributed.print0("hftrain: loss: the cross-entropy from the model's logits (training.loss_impl: logits)")
            return None
        if loss_impl == "fused":
            problem = fused_ce.problem(self.model, self.args.device.type, self.args.loss_averaging)
            if problem:
                raise ModelError(problem)
            self._fused = True
            distributed.print0("hftrain: loss: liger-kernel's fused linear cross-entropy over the target rows "
                               "(training.loss_impl: fused)")
            return chunked_ce.head_of(self.model)[:2]
        # Every strategy: FSDP2 and ZeRO-3 shard lm_head's weight, _ce has it gathered for the loss.
        head, math, why = chunked_ce.head_of(self.model)
        if not why:
            distributed.print0(f"hftrain: loss: hftrain's chunked cross-entropy over the target rows, no full logits "
                               f"(training.loss_impl: {loss_impl}; liger-kernel's fused loss only with "
                               "training.loss_impl: fused)")
            return head, math
        if loss_impl == "chunked":
            raise ModelError(f"training.loss_impl: chunked cannot be used: {why}; set training.loss_impl: auto "
                             "(the logits path where chunked is not supported) or logits")
        distributed.print0(f"hftrain: loss: the cross-entropy from the model's logits (training.loss_impl: auto; "
                           f"the chunked loss cannot run: {why})")
        return None

    def _forward(self, model, inputs: dict, loss_fn=None):
        """The model's outputs without labels (no model-internal loss); refuses a model that returns no logits.
        `loss_fn`: lm_head computes no logits but loss_fn(its input, chunked_ce.Captured), returned too
        (chunked_ce.capture_hidden)."""
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
        if loss_fn is not None:
            with chunked_ce.capture_hidden(self._head[0], loss_fn) as captured:
                return model(**inputs), captured
        outputs = model(**inputs)
        if getattr(outputs, "logits", None) is None:
            raise ValueError(
                f"{type(self.accelerator.unwrap_model(model)).__name__} returned no logits; hftrain computes the loss "
                "from logits (or, training.loss_impl: chunked, from lm_head's input) so that it is exact over the "
                "global batch"
            )
        return outputs

    def _ce(self, model, inputs: dict, labels: torch.Tensor, mode: str | None = None, label_smoothing: float = 0.0):
        """(outputs, the flattened per-position CE), or with `mode` (outputs, losses.loss_sum): chunked from
        lm_head's input when the loss is chunked, else from the logits."""
        pos = inputs.get("position_ids")
        if self._head is None:
            outputs = self._forward(model, inputs)
            ce = losses.target_ce(outputs.logits, labels[:, 1:], label_smoothing)
            return outputs, ce if mode is None else losses.sum_ce(ce, labels, mode, pos)
        math, chunk = self._head[1], self.loss_chunk_size
        if mode is None:
            return self._chunked(model, inputs, labels.shape, False, lambda h, c: losses.hidden_ce(
                h, c.weight, c.bias, labels, math, label_smoothing, chunk))
        return self._chunked(model, inputs, labels.shape, True, lambda h, c: losses.hidden_loss_sum(
            h, c.weight, c.bias, labels, mode, pos, math, label_smoothing, chunk, self._fused))

    def _aligned_loss_sum(self, model, inputs: dict, targets: torch.Tensor, weights: torch.Tensor,
                          label_smoothing: float = 0.0):
        """(outputs, sum(weights * CE)) where position i of the model's output predicts targets[:, i] (labels the
        loader already shifted: a sequence-parallel slice); `weights`: losses.weights_of, flattened."""
        if self._head is None:
            outputs = self._forward(model, inputs)
            return outputs, (losses.aligned_ce(outputs.logits, targets, label_smoothing) * weights).sum()
        math, chunk = self._head[1], self.loss_chunk_size
        return self._chunked(model, inputs, targets.shape, True, lambda h, c: losses.aligned_hidden_loss_sum(
            h, c.weight, c.bias, targets, weights, math, label_smoothing, chunk, self._fused))

    def _chunked(self, model, inputs: dict, shape: torch.Size, is_loss: bool, loss_fn):
        """(outputs, loss_fn(hidden (B, T, H), captured head)): the model run without logits, `loss_fn` computed
        inside lm_head's call (chunked_ce.capture_hidden says why); `is_loss`: a scalar loss backward runs through."""
        def in_head(h, c):
            # FSDP2 and ZeRO-3 hold the head's weight gathered during its call, as for its own matmul, and reduce the
            # gradient the loss gives it like the matmul's. A weight whose storage is freed cannot be read: refuse.
            if c.weight.untyped_storage().size() == 0:
                raise RuntimeError("lm_head's weight is not gathered in lm_head's forward; the chunked loss needs "
                                   "it: set training.loss_impl: logits")
            return loss_fn(h.reshape(*shape, h.shape[-1]), c)  # packed rows joined for flash: back in rows

        outputs, c = self._forward(model, inputs, in_head)
        out = c.loss
        if is_loss and self.is_deepspeed_enabled and out.requires_grad:  # ZeRO-3 pairs lm_head's backward hooks
            out = out + outputs.logits.sum() * 0  # see chunked_ce._Placeholder
        return outputs, out
