"""Guards of a run's integrity: finite-or-stop for every optimizer step, no non-finite weights saved, and the engine
the Trainer built is the strategy the recipe asked for.

- `StepGuard`: the training loss of each micro-batch is kept on the device; once per optimizer step, after the
  gradient norm is known and before the optimizer applies the update, every rank's (loss, grad norm) is gathered
  (one tiny collective, so every rank decides alike and none is left waiting). A non-finite value skips the step
  (up to `training.max_bad_steps`) or stops the run with a `NonFiniteError` naming the step, the value and the fixes.
  Under DeepSpeed, whose engine steps inside backward, the losses are judged before the step's last backward and
  the gradient norm only after the engine's step (mixin.py decides where each check runs).
- `check_finite_weights`: one pass over the parameters (each rank its own shards), the verdict all-gathered; a
  non-finite parameter refuses the save, naming it.
- `engine_problem` / `environment_engine_problem`: the engine actually built against the recipe's strategy, after the
  wrap and, where the environment already tells, before anything loads.

The package: steps.py (StepGuard), weights.py (check_finite_weights), engine.py (the engine checks), mixin.py (the
trainer's StepGuardMixin).
"""

from .engine import engine_built, engine_problem, environment_engine_problem, raise_engine_problem
from .mixin import StepGuardMixin
from .steps import StepGuard, stop_message
from .weights import check_finite_weights, nonfinite_parameters

__all__ = ["StepGuard", "StepGuardMixin", "check_finite_weights", "engine_built", "engine_problem",
           "environment_engine_problem", "nonfinite_parameters", "raise_engine_problem", "stop_message"]
