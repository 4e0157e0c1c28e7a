"""One benchmark evaluation, as `hftrain eval` and a run's `eval.harness` ask for it: the tasks (hftrain_heldout
written into a folder of its own for the harness to read), one task index for both models, the trained model and its
base evaluated, the table printed, written as JSON beside the model."""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field

from ..fileio import atomic_write
from .comparison import Comparison, compare, gate_failures, markdown
from .harness_runs import harness_results, model_arguments, task_manager
from .heldout_task import TASK, write_heldout_task


@dataclass(frozen=True)
class HarnessRequest:
    model: str
    base: str | None
    tasks: list[str] = field(default_factory=lambda: [TASK])
    include_path: str | None = None
    rows: list[str] = field(default_factory=list)  # hftrain_heldout's rows
    max_new_tokens: int = 32  # hftrain_heldout's answer length
    limit: int | None = None
    batch_size: int = 8
    device: str = "cpu"
    chat_template: bool = True
    trust_remote_code: bool = False


def checked_models(request: HarnessRequest) -> None:
    """Each a model folder (or an adapter on a local base), before any task is read."""
    for folder in (request.model, request.base):
        if folder:
            model_arguments(folder, request.device)


def _tasks(request: HarnessRequest, folder: str) -> list[str]:
    include = [request.include_path] if request.include_path else []
    if TASK in request.tasks:
        count = write_heldout_task(folder, request.rows, request.max_new_tokens)
        print(f"hftrain: {TASK}: {count} held-out rows from {', '.join(request.rows)} (answers up to "
              f"{request.max_new_tokens} tokens)")
        include.append(folder)
    return include


def evaluate(request: HarnessRequest) -> list[Comparison]:
    """The trained model against its base on the request's tasks; the table printed."""
    checked_models(request)
    with tempfile.TemporaryDirectory(prefix="hftrain-eval-tasks-") as folder:
        include = _tasks(request, folder)
        settings = (request.tasks, task_manager(request.tasks, include), request.limit, request.batch_size,
                    request.device, request.chat_template, request.trust_remote_code)
        trained = harness_results(request.model, *settings)
        before = harness_results(request.base, *settings) if request.base else None
    comparisons = compare(trained, before)
    print(f"hftrain: {request.model}" + (f" against its base {request.base}" if request.base else ""))
    print(markdown(comparisons), flush=True)
    return comparisons


def write_results(path: str, request: HarnessRequest, comparisons: list[Comparison]) -> None:
    summary = {"model": request.model, "base": request.base, "tasks": request.tasks, "limit": request.limit,
               "request": asdict(request), "comparisons": [c.as_dict() for c in comparisons]}
    atomic_write(path, json.dumps(summary, indent=1) + "\n")
    print(f"hftrain: written to {path}")


def gate_messages(comparisons: list[Comparison], min_delta: float, key: str) -> list[str]:
    """One line per metric that improved on the base by less than `min_delta` (`key`: how the setting is named)."""
    return [f"gate failed: {c.task} {c.metric} improved by {c.improvement:+.4f} (base {c.base:.4f} -> trained "
            f"{c.trained:.4f}), less than {key} {min_delta}" for c in gate_failures(comparisons, min_delta)]
