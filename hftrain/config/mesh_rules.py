"""The device mesh's rules (strategy.dp_replicate_size, dp_shard_size, tp_size, cp_size under fsdp): the degrees
against each other and the world size, and what cannot run on a mesh. Each problem is (key as the user spells it,
message with the fix); the model's heads and this machine's devices are judged where they are known
(launch.strategy_checks)."""

from __future__ import annotations

from .fields import is_number as _num
from .sections import CompressionSection, MoeSection, Problems, Recipe
from .strategy import MESH_OPTIONS, StrategySection


# Both paths to TP x FSDP2 measured at the pinned versions (4 CPU processes, tp 2 x fsdp 2, a tiny Llama):
# accelerate 1.15's FSDP2 preparation of a tensor-parallel model imports transformers.integrations.tensor_parallel's
# ReplicateParallel, which transformers 5.24 no longer has; transformers' own load-time DistributedConfig(tp_size=2,
# fsdp_size=2) gives the first step's gradients and updated weights of one process (to 1e-5) but a second loss
# 0.9% off (6.0317 against 5.9779), where TP alone and FSDP alone are exact: wrong, not refused, so refused here.
TP_WITH_FSDP = ("tensor parallelism with FSDP2 (a 2-D mesh) does not run right with the pinned accelerate 1.15 and "
                "transformers 5.24: accelerate's FSDP2 preparation of a tensor-parallel model imports "
                "transformers.integrations.tensor_parallel.ReplicateParallel, which transformers 5.24 removed, and "
                "transformers' own DistributedConfig(tp_size, fsdp_size) trains 0.9% off one process from the second "
                "step (measured)")


def mesh_problems(recipe: Recipe, name: str) -> Problems:
    """The mesh's degrees under strategy `name` (fsdp: all four; ddp: tp_size alone), every problem at once."""
    s = recipe.strategy
    if not isinstance(s, StrategySection) or all(getattr(s, k) is None for k in MESH_OPTIONS):
        return []
    out: Problems = [(f"strategy.{k}", f"must be at least 1, got {getattr(s, k)}")
                     for k in sorted(MESH_OPTIONS) if _num(getattr(s, k)) and getattr(s, k) < 1]
    if out:
        return out
    if _num(s.tp_size) and s.tp_size > 1:
        out += _tensor_parallel_problems(recipe, s, name)
    if name == "ddp":
        return out
    world = _world_problems(s)
    if world:
        return out + world
    mesh = s.mesh()
    if mesh.replicate > 1 and mesh.shard == 1 and mesh.tensor == mesh.context == 1:
        out.append(("strategy.dp_replicate_size", f"{mesh.replicate} replicas of an unsharded model is DDP: use "
                    "strategy.name: ddp, or shard within each replica (strategy.dp_shard_size > 1)"))
    elif mesh.replicate > 1 and mesh.shard == 1:
        out.append(("strategy.dp_replicate_size", "replicas of an unsharded model beside context parallelism are "
                    "refused by accelerate 1.15's ParallelismConfig: shard within each replica "
                    "(strategy.dp_shard_size > 1), or set dp_replicate_size: 1"))
    if mesh.beyond_sharding:
        out += _beside_the_mesh(recipe, mesh)
    return out


def mesh_refusal(recipe: Recipe, who: str) -> Problems:
    """`who` (a method, images) does not run on a device mesh past sharding: the first mesh key set, with the fix."""
    s = recipe.strategy
    if not isinstance(s, StrategySection):
        return []
    for key in ("dp_replicate_size", "tp_size", "cp_size"):
        if _num(getattr(s, key)) and getattr(s, key) > 1:
            return [(f"strategy.{key}", f"{who} does not run on a device mesh (HSDP, tensor or context parallelism: "
                     "built and tested exact for supervised fine-tuning of text only); remove the mesh's degrees "
                     "(strategy.dp_replicate_size, tp_size, cp_size)")]
    return []


def _world_problems(s: StrategySection) -> Problems:
    """The degrees' product is the world size (the shard degree, unset, is what the others leave of it)."""
    world = s.resolved_num_processes()
    others = {k: getattr(s, k) for k in ("dp_replicate_size", "tp_size", "cp_size") if _num(getattr(s, k))}
    product = 1
    for v in others.values():
        product *= v
    named = " x ".join(f"strategy.{k} ({v})" for k, v in others.items() if v > 1) or "1"
    if _num(s.dp_shard_size):
        if product * s.dp_shard_size == world:
            return []
        fix = (f"set it to {world // product}" if world % product == 0 else
               f"make strategy.num_processes a multiple of {product}")
        return [("strategy.dp_shard_size", f"{named} x strategy.dp_shard_size ({s.dp_shard_size}) must equal "
                 f"strategy.num_processes ({world}): {fix}, or leave it unset (what the other degrees leave)")]
    if world % product:
        return [("strategy.num_processes", f"must be a multiple of {named} = {product} (the mesh's degrees; the "
                 f"shard degree takes what they leave), got {world}")]
    return []


def _tensor_parallel_problems(recipe: Recipe, s: StrategySection, name: str) -> Problems:
    """Tensor parallelism (transformers splits each layer at load time; its Trainer then builds accelerate's mesh):
    alone over every rank, under ddp; what it is not built or tested with."""
    out: Problems = []
    world = s.resolved_num_processes()
    if name == "fsdp":
        out.append(("strategy.tp_size", f"{TP_WITH_FSDP}. Use strategy.name: ddp with strategy.tp_size equal to "
                    "strategy.num_processes (tensor parallelism alone), or fsdp without tp_size"))
    elif s.tp_size != world:
        out.append(("strategy.tp_size", f"must equal strategy.num_processes ({world}) under ddp: accelerate 1.15 "
                    "refuses tensor parallelism beside data-parallel replicas, and with FSDP2 on a 2-D mesh too "
                    "(ReplicateParallel, removed from transformers 5.24); set num_processes to the tensor-parallel "
                    "degree"))
    t = recipe.typed_training
    if t.save_only_model is not True and str(t.save_strategy) != "no":
        out.append(("training.save_only_model", "must be true with strategy.tp_size: transformers 5.24 cannot "
                    "checkpoint the optimizer state of a model it split at load time, so its checkpoints hold the "
                    "weights only (resume them with training.resume_weights_only: true); or set "
                    "training.save_strategy: no"))
    m = recipe.model
    for key, value in (("model.lora", m.lora if m else None), ("model.quantization", m.quantization if m else None)):
        if value is not None:
            out.append((key, "cannot be combined with strategy.tp_size (not built here: peft's and bitsandbytes' "
                        "layers on transformers' split weights are not tested); train the full model, or remove "
                        "tp_size"))
    if t.loss_impl in ("chunked", "fused"):
        out.append(("training.loss_impl", f"{t.loss_impl} computes the loss from lm_head's weight, which "
                    "strategy.tp_size splits over the ranks; use training.loss_impl: auto or logits"))
    if recipe.moe is not None:
        out.append(("moe", "cannot be combined with strategy.tp_size (experts are not split by the tensor-parallel "
                    "plan here); remove one of them"))
    return out


def _beside_the_mesh(recipe: Recipe, mesh) -> Problems:
    """What the mesh's runs are not built or tested with."""
    out: Problems = []
    c = recipe.compression
    if isinstance(c, CompressionSection) and c.method not in (None, "none"):
        out.append(("compression.method", "is not applied on a device mesh (HSDP's all-reduce across replicas is "
                    "FSDP2's own): remove compression, or remove the mesh's degrees"))
    if isinstance(recipe.moe, MoeSection) and _num(recipe.moe.expert_parallel_size) and \
            recipe.moe.expert_parallel_size > 1:
        out.append(("moe.expert_parallel_size", "builds its own expert-parallel groups over the world and cannot "
                    "share it with the device mesh: set it to 1, or remove the mesh's degrees"))
    return out
