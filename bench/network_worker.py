"""bench/network.py's worker: recipes/sft.py unchanged, plus a clock of training time.

    accelerate launch ... bench/network_worker.py RECIPE OUT_JSON TARGET BUDGET [key=value ...]

Training time is the wall time since training began less the time spent evaluating (each evaluation's own
eval_runtime), so the frequent held-out evaluations that locate the moment a loss is reached cost no method
anything. The run stops, on every rank at the same step, once an evaluation reaches TARGET (eval loss; 0: never) or
once the training time passes BUDGET seconds (0: never); the budget is judged on rank 0's clock and broadcast (one
1-element all-reduce per step), since the ranks' clocks differ by a little. OUT_JSON gets, per step, the training
time, and per evaluation (step, training time, eval loss).

The callback is added by replacing sft.py's CurvesCallback with a subclass of it: the bench measures the recipe as a
user runs it, and the recipe has no hook for extra callbacks (none is needed outside this measurement).
"""

import json
import sys
import time

import torch
import torch.distributed as dist

from hftrain import distributed, lifecycle
from hftrain.callbacks import CurvesCallback
from hftrain.errors import exit_on_user_error
from hftrain.recipes import sft


class Clock(CurvesCallback):
    out, target, budget = "", 0.0, 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0, self.eval_time, self.steps, self.evals = time.perf_counter(), 0.0, [], []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0 - self.eval_time

    def on_step_end(self, args, state, control, **kwargs):
        now = self.elapsed()
        self.steps.append([state.global_step, now])
        if self.budget > 0:
            over = torch.tensor([float(now > self.budget) if distributed.is_main_process() else 0.0])
            if dist.is_initialized():
                dist.all_reduce(over)
            if over.item() > 0:
                control.should_training_stop = True

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.eval_time += metrics.get("eval_runtime", 0.0)
        loss = metrics["eval_loss"]
        self.evals.append([state.global_step, self.steps[-1][1] if self.steps else 0.0, loss])
        if self.target > 0 and loss <= self.target:  # the same eval loss on every rank: the same decision
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        super().on_train_end(args, state, control, **kwargs)
        if distributed.is_main_process():
            with open(self.out, "w") as fh:
                json.dump({"steps": self.steps, "evals": self.evals}, fh)


if __name__ == "__main__":
    recipe, Clock.out, target, budget, *overrides = sys.argv[1:]
    Clock.target, Clock.budget = float(target), float(budget)
    lifecycle.CurvesCallback = Clock  # the run's curves callback, with the clock added
    with exit_on_user_error():
        sft.main([recipe, *overrides])
