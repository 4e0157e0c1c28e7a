"""Benchmark evaluation after a run (`hftrain eval`): lm-evaluation-harness on the trained model and its base, side
by side, with a gate. heldout_task.py: a run's held-out conversations as a harness task (generate-until, exact match
as the run's own eval.exact_match counts it); harness_runs.py: the harness on one model folder (a full model, or a
LoRA run's adapter on its base); comparison.py: base against trained, the table, the gate; evaluation.py: one
evaluation as the command and a run's eval.harness ask for it; after_run.py: eval.harness, checked and run."""

from .after_run import evaluate_after_training, harness_problems
from .comparison import Comparison, compare, gate_failures, markdown
from .evaluation import HarnessRequest, evaluate, gate_messages, write_results
from .harness_runs import harness_results, model_arguments, task_manager
from .heldout_task import TASK, write_heldout_task

__all__ = ["Comparison", "compare", "gate_failures", "markdown", "harness_results", "model_arguments", "task_manager",
           "TASK", "write_heldout_task", "HarnessRequest", "evaluate", "gate_messages", "write_results",
           "evaluate_after_training", "harness_problems"]
