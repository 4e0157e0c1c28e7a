"""Negative control for tests/test_moe.py: recipes/sft.py with expert parallelism but the expert gradients NOT
divided by the world size (the parameters are re-made without hftrain's gradient hooks). Never used elsewhere."""

import runpy
import sys

import torch

from hftrain.moe import expert_parallel as ep

_parallelize = ep.parallelize


def parallelize_without_grad_scaling(model, group=None, capacity_factor=None):
    n = _parallelize(model, group, capacity_factor)
    for m in model.modules():
        if isinstance(m, ep.ExpertParallelMoE):
            for name in ("gate_up_proj", "down_proj"):
                setattr(m.experts, name, torch.nn.Parameter(getattr(m.experts, name).detach().clone()))
    return n


ep.parallelize = parallelize_without_grad_scaling
sys.argv = ["recipes/sft.py", *sys.argv[1:]]
runpy.run_path("recipes/sft.py", run_name="__main__")
