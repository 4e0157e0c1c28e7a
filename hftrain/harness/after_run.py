"""eval.harness: the run benchmarks itself after its final save, as `hftrain eval` would on its folder. Under every
strategy it runs on the saved folder (consolidated safetensors, or the adapter on its base, or merged/ for QLoRA), in
the main process alone after the others have finished, and says so; a gate the recipe set (min_delta) that is
missed fails the run before any push. preflight asks harness_problems first."""

from __future__ import annotations

import importlib.util
import os

import torch

from .. import distributed
from ..config import Recipe
from ..constants import HARNESS_RESULTS_FILE
from ..errors import DataError, GateError
from ..modeling import resolved_name_or_path
from .evaluation import HarnessRequest, evaluate, gate_messages, write_results
from .heldout_task import TASK, checked_rows

KEY = "eval.harness"
MERGED = "merged"


def _eval_rows(recipe: Recipe) -> list[str]:
    return [s.path for s in (recipe.data.eval_sources or [])] if recipe.data is not None else []


def harness_problems(recipe: Recipe, environment: bool) -> list[tuple[str, str]]:
    """(key, message) for what eval.harness cannot run as asked."""
    section = recipe.eval.harness if recipe.eval is not None else None
    if section is None:
        return []
    out = []
    if environment and importlib.util.find_spec("lm_eval") is None:
        out.append((KEY, "needs lm-evaluation-harness here: pip install 'hftrain[eval]' (or lm-eval)"))
    if TASK in section.tasks and not _eval_rows(recipe):
        out.append((f"{KEY}.tasks", f"{TASK} is the run's held-out rows: set data.eval_sources, or name other tasks"))
    for path in _eval_rows(recipe) if environment and TASK in section.tasks else []:
        try:
            checked_rows(path)
        except DataError as e:
            out.append((f"{KEY}.tasks", str(e)))
    if environment and section.include_path and not os.path.isdir(section.include_path):
        out.append((f"{KEY}.include_path", f"{section.include_path} is not a folder of task YAMLs"))
    m = recipe.model
    if m is not None and m.lora and m.quantization is not None and not m.lora.merge:
        out.append((KEY, "a QLoRA adapter is evaluated as its merged model (its base was quantised in training, the "
                         "harness would load it unquantised): set model.lora.merge: true"))
    return out


def evaluate_after_training(recipe: Recipe) -> None:
    """eval.harness on the saved model, in the main process; a GateError where min_delta is missed."""
    section = recipe.eval.harness if recipe.eval is not None else None
    if section is None or not distributed.is_main_process():
        return
    merged = os.path.join(recipe.output_dir, MERGED)
    model = merged if recipe.model.lora and os.path.isfile(os.path.join(merged, "config.json")) else recipe.output_dir
    base = resolved_name_or_path(recipe.model.name_or_path)
    print(f"hftrain: {KEY}: the saved model in {model} against {base}, in this process (the main one; the other "
          "ranks have finished)", flush=True)
    request = HarnessRequest(model, base, list(section.tasks), section.include_path, _eval_rows(recipe),
                             recipe.eval.max_new_tokens, section.limit,
                             device="cuda" if torch.cuda.is_available() else "cpu",
                             trust_remote_code=recipe.model.trust_remote_code)
    comparisons = evaluate(request)
    write_results(os.path.join(recipe.output_dir, HARNESS_RESULTS_FILE), request, comparisons)
    if section.min_delta is not None:
        failed = gate_messages(comparisons, section.min_delta, f"{KEY}.min_delta")
        if failed:
            raise GateError("; ".join(failed) + f" (the saved model and {HARNESS_RESULTS_FILE} stay in "
                            f"{recipe.output_dir}; nothing was pushed)")
