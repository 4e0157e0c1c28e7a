"""The recipe's `eval:` section: generation-based evaluation during the run (exact match) and the benchmark
evaluation after it (eval.harness: hftrain/harness/)."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import option


@dataclass
class HarnessSection:
    tasks: list[str] = option(help="lm-evaluation-harness tasks run on the saved model and on its base after training "
                              "(hftrain_heldout: the run's held-out rows, data.eval_sources)",
                              factory=lambda: ["hftrain_heldout"])
    include_path: str | None = option(None, "A folder of your own harness task YAMLs.")
    limit: int | None = option(None, "Evaluate the first N rows of each task only.")
    min_delta: float | None = option(
        None, "Fail the run (exit 2, before any push) when a metric improves on the base by less than this.")


@dataclass
class EvalSection:
    exact_match: int = option(
        0, "Greedy-generate answers for this many held-out examples and report exact-match accuracy before and after "
        "training."
    )
    max_new_tokens: int = option(32, "Generation length for exact_match (and for the harness's hftrain_heldout).")
    harness: HarnessSection | None = option(
        None, "Benchmark the saved model against its base with lm-evaluation-harness after training, on the main "
        "process (`hftrain eval`'s table, in eval_harness.json and on the model card).")
