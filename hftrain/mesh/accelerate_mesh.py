"""The recipe's mesh as accelerate's ParallelismConfig, and the launcher's (PARALLELISM_CONFIG_*, exported from an
accelerate config's parallelism_config) held against it: hftrain takes the mesh from the recipe only."""

from __future__ import annotations

import os

from ..config.strategy import Mesh

# accelerate's launcher exports each degree as PARALLELISM_CONFIG_<NAME>_SIZE (accelerate/utils/launch.py)
LAUNCHER_DEGREES = {"replicate": "DP_REPLICATE", "shard": "DP_SHARD", "tensor": "TP", "context": "CP"}
RECIPE_KEYS = {"replicate": "dp_replicate_size", "shard": "dp_shard_size", "tensor": "tp_size", "context": "cp_size"}


def parallelism_config(mesh: Mesh):
    """accelerate's ParallelismConfig of the mesh: the Trainer's Accelerator builds the device mesh from it (its
    order: dp_replicate, dp_shard, cp, tp) and FSDP2 shards over dp_shard x cp, replicating over dp_replicate."""
    from accelerate import ParallelismConfig  # accelerate is imported by the run's arguments anyway; kept lazy here

    return ParallelismConfig(dp_replicate_size=mesh.replicate, dp_shard_size=mesh.shard, tp_size=mesh.tensor,
                             cp_size=mesh.context)


def launcher_mesh(env=None) -> Mesh | None:
    """The mesh the launcher's config asked for, None when it named none."""
    env = os.environ if env is None else env
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() != "true":
        return None
    return Mesh(**{k: int(env.get(f"PARALLELISM_CONFIG_{v}_SIZE", "1") or 1) for k, v in LAUNCHER_DEGREES.items()})


def launcher_mesh_problem(mesh: Mesh, env=None) -> str | None:
    """The launcher's mesh against the recipe's (an FSDP run): the degrees that differ, named, with the fix."""
    launched = launcher_mesh(env)
    if launched is None or launched == mesh:
        return None
    differ = [f"strategy.{RECIPE_KEYS[k]} {getattr(mesh, k)} (the launcher's {getattr(launched, k)})"
              for k in LAUNCHER_DEGREES if getattr(mesh, k) != getattr(launched, k)]
    return ("the launcher's config asks for another device mesh than the recipe: " + ", ".join(differ) +
            ". hftrain takes the mesh from the recipe: launch with `hftrain launch`, or render the launcher's config "
            "from the recipe (`hftrain config <recipe.yaml>`)")


def tensor_parallel_config(size: int):
    """transformers' DistributedConfig splitting each layer over `size` ranks by the family's tp_plan at load time
    (the process group must exist: the run's arguments start it)."""
    from transformers.distributed import DistributedConfig  # heavy: only a tensor-parallel load needs it

    return DistributedConfig(tp_size=size)


def gathered_state_dict(model) -> dict:
    """The full weights of a model split at load time (tensor parallelism), each DTensor gathered: a collective every
    rank calls."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
