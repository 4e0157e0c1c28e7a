"""Negative control for tests/test_moe.py: recipes/sft.py with the aux loss added the naive way, coef * aux on
every micro-batch's loss (not divided by the accumulation steps). Never used outside that test."""

import runpy
import sys

from hftrain.losses import maths as losses  # where the trainer looks it up (losses/exact.py)

losses.aux_loss_term = lambda aux, coef, accumulation_steps: coef * aux
sys.argv = ["recipes/sft.py", *sys.argv[1:]]
runpy.run_path("recipes/sft.py", run_name="__main__")
