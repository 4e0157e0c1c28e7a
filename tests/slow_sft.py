"""hftrain's SFT recipe with every training step slowed by HFTRAIN_TEST_STEP_SLEEP seconds (default 0), so that a
test can kill a run between two checkpoints. It only sleeps: the numerics are the recipe's. With
HFTRAIN_TEST_SLEEP_UNTIL_RESTART=1 a restarted run (a requeued SLURM job) does not sleep."""

import os
import time

from hftrain.recipes import sft
from hftrain.methods.sft import SFTTrainer

_training_step = SFTTrainer.training_step


def training_step(self, *args, **kwargs):
    restarted = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
    if not (restarted and os.environ.get("HFTRAIN_TEST_SLEEP_UNTIL_RESTART") == "1"):
        time.sleep(float(os.environ.get("HFTRAIN_TEST_STEP_SLEEP", "0")))
    return _training_step(self, *args, **kwargs)


SFTTrainer.training_step = training_step
sft.main()
