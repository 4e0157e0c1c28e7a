"""The per-token cross-entropy a trainer's loss is built from: from the model's logits, or (training.loss_impl
chunked / auto) from lm_head's input in chunks, never materialising the full logits (hftrain/chunked_ce.py holds the
maths, hftrain/losses.py the sums). No labels reach the model, so no model-internal loss runs.
"""

from __future__ import annotations

import torch

from .. import chunked_ce, distributed, losses
from ..errors import ModelError


class ChunkedLossMixin:
    """`self._head`: (lm_head, its maths) when the loss is chunked, else None; `_forward` / `_ce` for the loss."""

    loss_chunk_size: int | None = None  # target tokens per chunk of the chunked loss (None: by vocabulary)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head = self._chunked_head(self.args.loss_impl)

    def _chunked_head(self, loss_impl: str):
        """training.loss_impl -> (lm_head, its maths) for the chunked loss, or None for the logits path."""
        if loss_impl == "logits":
            return None
        # Every strategy: FSDP2 and ZeRO-3 shard lm_head's weight, _ce has it gathered for the loss.
        head, math, why = chunked_ce.head_of(self.model)
        if not why:
            return head, math
        if loss_impl == "chunked":
            raise ModelError(f"training.loss_impl: chunked cannot be used: {why}; set training.loss_impl: auto "
                             "(the logits path where chunked is not supported) or logits")
        distributed.print0(f"hftrain: training.loss_impl auto: the loss is computed from logits ({why})")
        return None

    def _forward(self, model, inputs: dict, capture: bool = False):
        """The model's outputs without labels (no model-internal loss); refuses a model that returns no logits.
        `capture`: lm_head computes no logits and its input is returned too (chunked_ce.capture_hidden)."""
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
        if capture:
            with chunked_ce.capture_hidden(self._head[0]) as captured:
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
        outputs, c = self._forward(model, inputs, capture=True)
        # FSDP2: c.weight is the unsharded parameter lm_head ran with (a plain tensor). accelerate's FSDP2 puts lm_head
        # in a unit with reshard_after_forward=False (the root's default too), so it is still gathered here, and the
        # gradient the chunked loss accumulates into it is reduce-scattered by that unit's post-backward like
        # lm_head's own. ZeRO-3 releases it after lm_head's forward: gathered again for the loss (Captured.gathered),
        # its gradient reduce-scattered by DeepSpeed's hook on the parameter. Freed storage here: refuse to read it.
        hidden = c.hidden.reshape(*labels.shape, c.hidden.shape[-1])  # packed rows joined for flash: back in rows
        with c.gathered(self.is_deepspeed_enabled), c.autocast():  # the head's matmul in the model's forward dtype
            if c.weight.untyped_storage().size() == 0:
                raise RuntimeError("lm_head's weight is not gathered after the model's forward (resharded); the "
                                   "chunked loss needs it: set training.loss_impl: logits")
            if mode is None:
                return outputs, losses.hidden_ce(hidden, c.weight, c.bias, labels, self._head[1], label_smoothing,
                                                 self.loss_chunk_size)
            loss = losses.hidden_loss_sum(hidden, c.weight, c.bias, labels, mode, pos, self._head[1],
                                          label_smoothing, self.loss_chunk_size)
        if self.is_deepspeed_enabled and loss.requires_grad:  # ZeRO-3 pairs lm_head's backward hooks: see _Placeholder
            loss = loss + outputs.logits.sum() * 0
        return outputs, loss
