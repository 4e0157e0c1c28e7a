"""Negative control for tests/test_sequence_parallel_runs.py: recipes/sft.py under sequence parallelism without
patches.deepspeed.average_gradients_over_sequence_ranks (ZeRO-1/2 then divide the gradients by the data-parallel
size, not the world size). Never used outside that test."""

import runpy
import sys

from hftrain.launch import setup

setup.average_gradients_over_sequence_ranks = lambda: None
sys.argv = ["recipes/sft.py", *sys.argv[1:]]
runpy.run_path("recipes/sft.py", run_name="__main__")
