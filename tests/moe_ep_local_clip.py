"""Negative control for tests/test_moe.py: recipes/sft.py with expert parallelism but the Trainer's own gradient norm
(each rank's dense gradients and its own experts only), not moe/mixin.py's over every rank's experts. Never used
elsewhere."""

import runpy
import sys

from transformers import Trainer

from hftrain.moe.mixin import MoeMixin

MoeMixin._clip_grad_norm = Trainer._clip_grad_norm
MoeMixin._get_grad_norm = Trainer._get_grad_norm
sys.argv = ["recipes/sft.py", *sys.argv[1:]]
runpy.run_path("recipes/sft.py", run_name="__main__")
