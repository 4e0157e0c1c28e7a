"""recipes/sft.py with every training step slowed by HFTRAIN_TEST_STEP_SLEEP seconds (default 0), so that a test
can kill a run between two checkpoints. It only sleeps: the numerics are recipes/sft.py's."""

import os
import runpy
import sys
import time

from hftrain.trainer import HFTrainer

SFT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "sft.py")
_training_step = HFTrainer.training_step


def training_step(self, *args, **kwargs):
    time.sleep(float(os.environ.get("HFTRAIN_TEST_STEP_SLEEP", "0")))
    return _training_step(self, *args, **kwargs)


HFTrainer.training_step = training_step
sys.argv = [SFT, *sys.argv[1:]]
runpy.run_path(SFT, run_name="__main__")
