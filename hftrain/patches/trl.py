"""Changes to TRL (written against 1.16).

1. `place_references_with`: TRL's trainers that keep a frozen reference copy place it under FSDP with
   `trl.models.prepare_fsdp`, which under FSDP2 calls fully_shard on the whole model as one unit: every forward of
   the reference gathers the whole model on each device, while the memory plan (launch/plan.py) counts it sharded
   as the policy (a reference sized for 8-way FSDP2 passes the plan and runs out of memory, as the distillation
   teacher did before methods/frozen.py). `prepare_fsdp` is pointed at hftrain's placement (methods/frozen.py: per
   layer, as accelerate prepares the policy) for FSDP2, TRL's own otherwise: in trl.models, where a trainer module
   imported later takes it from, and in every TRL module already imported that holds it. It can go when TRL's
   prepare_fsdp wraps per layer.
"""

from __future__ import annotations

import sys


def place_references_with(place_fsdp2) -> None:
    """TRL's `prepare_fsdp` placing an FSDP2 reference with `place_fsdp2(model, accelerator)` (TRL's own for FSDP1),
    wherever TRL holds it. Idempotent."""
    import trl.models  # heavy: FSDP runs only (an SFT recipe's check imports no TRL)
    original = getattr(trl.models.prepare_fsdp, "trl_original", trl.models.prepare_fsdp)

    def prepare_fsdp(model, accelerator):
        if accelerator.state.fsdp_plugin.fsdp_version == 2:
            return place_fsdp2(model, accelerator)
        return original(model, accelerator)

    prepare_fsdp.trl_original = original
    for name, module in list(sys.modules.items()):
        if name.startswith("trl.") and getattr(module, "prepare_fsdp", None) in (original, trl.models.prepare_fsdp):
            module.prepare_fsdp = prepare_fsdp
    trl.models.prepare_fsdp = prepare_fsdp
