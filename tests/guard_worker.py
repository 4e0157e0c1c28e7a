"""recipes/sft.py with test-only faults, set by environment variables (never production options):
- HFTRAIN_TEST_NAN_STEPS="2,3" (and HFTRAIN_TEST_NAN_RANK=1): the logits, hence the loss, of those optimizer
  steps (global_step + 1) are NaN on that rank (on every rank when unset), as a bad batch or a diverged model gives;
- HFTRAIN_TEST_DIGESTS=<path>: rank 0 appends {"step", "digest"} of the weights before the first step (step 0) and
  after each optimizer step, one JSON per line;
- HFTRAIN_TEST_NO_EARLY_ENGINE_CHECK=1: preflight's environment check of the engine is switched off, so that the
  check after the Trainer's wrap is the one that meets the environment's effect;
- HFTRAIN_TEST_EXIT_DIR=<dir>: each rank writes rank<r>.json = {"code", "time"} as it exits (that every rank ended
  by itself, and when).
Run as a script (by a launcher) it applies them and runs recipes/sft.py; imported, it only defines them."""

import json
import os
import sys
import time

from transformers import TrainerCallback

from hftrain import distributed
from hftrain.artifacts import weights_digest
from hftrain.errors import exit_on_user_error
from hftrain.launch import strategy_checks
from hftrain.recipes import sft
from hftrain.methods.sft import SFTTrainer

_forward = SFTTrainer._forward
_init = SFTTrainer.__init__


def forward(self, model, inputs, loss_fn=None):
    """SFTTrainer._forward whose logits (or, on the chunked loss path, lm_head's input) are NaN on the chosen steps
    and rank (as a bad batch or a diverged model gives): the loss computed from them, and its gradients, are NaN."""
    steps = {int(s) for s in os.environ.get("HFTRAIN_TEST_NAN_STEPS", "").split(",") if s}
    rank = os.environ.get("HFTRAIN_TEST_NAN_RANK")
    nan = model.training and self.state.global_step + 1 in steps and (rank is None or int(rank) == distributed.rank())
    if loss_fn is not None:  # the chunked loss is computed inside lm_head's call, from its input
        inner = loss_fn
        return _forward(self, model, inputs, (lambda h, c: inner(h * float("nan"), c)) if nan else inner)
    result = _forward(self, model, inputs)
    if nan:
        result.logits = result.logits * float("nan")
    return result


class Digests(TrainerCallback):
    def __init__(self, path):
        self.path = path

    def _write(self, step, model):
        if distributed.is_main_process():
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"step": step, "digest": weights_digest(model)}) + "\n")

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._write(state.global_step, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._write(state.global_step, model)


def init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if os.environ.get("HFTRAIN_TEST_DIGESTS"):
        self.add_callback(Digests(os.environ["HFTRAIN_TEST_DIGESTS"]))


if __name__ == "__main__":
    SFTTrainer._forward = forward
    SFTTrainer.__init__ = init
    if os.environ.get("HFTRAIN_TEST_NO_EARLY_ENGINE_CHECK") == "1":
        strategy_checks.environment_engine_problem = lambda *a, **k: None
    code = 0
    try:
        with exit_on_user_error():
            sft.main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
        raise
    except BaseException:
        code = 1
        raise
    finally:
        if os.environ.get("HFTRAIN_TEST_EXIT_DIR"):
            with open(os.path.join(os.environ["HFTRAIN_TEST_EXIT_DIR"], f"rank{distributed.rank()}.json"), "w") as fh:
                json.dump({"code": code, "time": time.time()}, fh)
