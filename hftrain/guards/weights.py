"""No non-finite weights saved: one pass over the parameters (each rank its own shards), the verdict all-gathered; a
non-finite parameter refuses the save, naming it."""

from __future__ import annotations

import torch

from .. import distributed
from ..errors import NonFiniteError


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: a DTensor's local shard (FSDP2), a ZeRO-3 partition, else the tensor."""
    if hasattr(p, "ds_tensor"):  # ZeRO-3: p.data is an empty placeholder outside a gather
        return p.ds_tensor
    if hasattr(p, "to_local"):
        return p.to_local()
    return p


PACKED_LAYERS = ("Linear4bit", "Linear8bitLt")  # bitsandbytes' layers (QLoRA): their weight holds packed integers


def _packed_weights(model) -> set[int]:
    """ids of the frozen quantised weights: packed integers, whatever dtype they are stored in (a float storage
    dtype, which FSDP needs to shard them, shows their bytes as floats, some of them NaN patterns)."""
    return {id(m.weight) for m in model.modules() if type(m).__name__ in PACKED_LAYERS}


@torch.no_grad()
def nonfinite_parameters(model) -> list[str]:
    """Names of this rank's parameters (its shards) that hold a NaN or an infinity: one pass over the weights (not
    a quantised base's packed weights, which are not numbers of their own and never change)."""
    packed = _packed_weights(model)
    named = [(n, _local(p)) for n, p in model.named_parameters() if id(p) not in packed]
    named = [(n, t) for n, t in named if t.numel() and t.is_floating_point()]
    if not named:
        return []
    flags = torch.stack([torch.isfinite(t).all() for _, t in named]).cpu()
    return [n for (n, _), ok in zip(named, flags.tolist()) if not ok]


def check_finite_weights(model, what: str) -> None:
    """Raise NonFiniteError naming the first non-finite parameter of any rank; every rank must call it (it
    all-gathers the verdict, so every rank raises alike)."""
    local = nonfinite_parameters(model)
    found = [(r, names) for r, names in enumerate(distributed.all_gather_object(local)) if names]
    if found:
        rank, names = found[0]
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        where = f" (rank {rank}'s shard)" if distributed.world_size() > 1 else ""
        raise NonFiniteError(
            f"refusing to save {what}: parameter {names[0]}{more}{where} holds NaN or infinite values. Training "
            "diverged; lower training.learning_rate or enable training.max_grad_norm, and resume from the last "
            "checkpoint written before it")


# -- the engine ----------------------------------------------------------------------------------------------------
