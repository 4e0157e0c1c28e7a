"""TRL's fused LM head (trl.trainer.utils.add_fused_lm_head: DPO, GRPO, KTO) under FSDP2: the head's unit unsharded
before each forward, so that its gradient is every rank's and not each rank's own.

TRL projects the hidden states through `lm_head.weight` read from the module, without calling the module. accelerate's
FSDP2 preparation (1.15, fsdp2_prepare_model) carves the head into a unit of its own, grouped with the final norm when
it finds one among the base model's direct children (Llama's model.norm) and alone where it does not (an
image-text-to-text model's norm sits in its language model). Alone, the unit is unsharded only when the head is
called, which TRL never does: TRL reads the DTensor shard and gathers it with full_tensor(), whose backward hands each
rank its own gradient for its own rows, never reduced. Measured on a tiny Qwen2.5-VL under DPO: after one step every
other weight equal to one rank's, the head's update 1.5x and turned (tests/test_vision_dpo.py). Unsharded first (the
unit keeps its parameters unsharded after forward: accelerate prepares the tail so), the head is a plain tensor in
TRL's projection and FSDP's end-of-backward callback reduce-scatters its gradient with the rest. It can go when TRL
calls the head through its module or accelerate groups it with the norm it cannot find."""

from __future__ import annotations


class FusedHeadMixin:
    """compute_loss with the policy's output embeddings unsharded first where FSDP2 made them a unit of their own."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        head_unit(self.accelerator.unwrap_model(model))
        return super().compute_loss(model, inputs, *args, **kwargs)


def head_unit(model) -> None:
    """Unshard `model`'s output embeddings when they are an FSDP2 unit (else nothing: DDP, ZeRO, one process)."""
    from torch.distributed.fsdp import FSDPModule  # FSDP2 runs only

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if isinstance(head, FSDPModule):
        head.unshard()
