"""Negative control for tests/test_moe.py: recipes/sft.py with expert parallelism but the expert gradients NOT
divided by the world size (the layer's ScaleGrad replaced by the identity). Never used elsewhere."""

import runpy
import sys

from hftrain.moe import expert_parallel as ep

ep.scale_grad = lambda weight, scale: weight
sys.argv = ["recipes/sft.py", *sys.argv[1:]]
runpy.run_path("recipes/sft.py", run_name="__main__")
