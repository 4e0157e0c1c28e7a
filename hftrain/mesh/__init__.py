"""Meshes past data parallelism (strategy fsdp's dp_replicate_size, dp_shard_size, tp_size, cp_size): the
ParallelismConfig a run hands its arguments, the launcher's mesh checked against the recipe's. The degrees and their
rules are the recipe's (config/strategy.py, config/mesh_rules.py)."""

from .accelerate_mesh import (RECIPE_KEYS, gathered_state_dict, launcher_mesh_problem, parallelism_config,
                              tensor_parallel_config)
from .model_rules import tensor_parallel_problem

__all__ = ["RECIPE_KEYS", "gathered_state_dict", "launcher_mesh_problem", "parallelism_config",
           "tensor_parallel_config", "tensor_parallel_problem"]
