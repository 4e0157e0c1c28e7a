"""`hftrain eval MODEL`: lm-evaluation-harness on a run's model and its base, side by side (hftrain/harness/). A run
folder (it holds recipe.yaml) gives its base (model.name_or_path), its held-out rows (data.eval_sources: the task
hftrain_heldout) and eval.max_new_tokens; the table is printed and written to the run folder (eval_harness.json),
whence `hftrain push` puts it on the model card. --min-delta D exits 1 when a metric improves by less than D."""

from __future__ import annotations

import os
import sys

import yaml

from ..constants import HARNESS_RESULTS_FILE, RECIPE_FILE
from ..errors import DataError, ModelError
from ..harness import TASK, HarnessRequest, evaluate, gate_messages, write_results

GATE_FAILED = 1
DEFAULT_MAX_NEW_TOKENS = 32


def run_recipe(folder: str) -> dict:
    """A run folder's resolved recipe ({} for a plain model folder)."""
    path = os.path.join(folder, RECIPE_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def base_of(ns, recipe: dict) -> str | None:
    if ns.no_base:
        return None
    base = ns.base or (recipe.get("model") or {}).get("name_or_path")
    if base is None:
        return None
    if not os.path.isdir(base):
        raise ModelError(f"the base model {base!r} is not a local folder here (paths are read from the working "
                         "directory, as the run read them): give it with --base FOLDER, or --no-base")
    return base


def heldout_rows(ns, recipe: dict) -> list[str]:
    if ns.rows:
        return ns.rows
    return [s["path"] for s in ((recipe.get("data") or {}).get("eval_sources") or []) if s.get("path")]


def quantized_adapter_problem(folder: str, recipe: dict) -> None:
    """A QLoRA run's adapter was trained on a quantised base, which the harness would load unquantised: its merged/
    folder (hub.merge_lora) is the model a QLoRA run serves."""
    if (recipe.get("model") or {}).get("quantization") and os.path.isfile(os.path.join(folder, "adapter_config.json")):
        merged = os.path.join(folder, "merged")
        raise ModelError(f"{folder}: a QLoRA run's adapter, trained on a quantised base the harness would load "
                         f"unquantised; evaluate its merged model instead (`hftrain eval {merged} --base BASE`, "
                         "written by a run with hub.merge_lora: true)")


def request_of(ns, recipe: dict) -> HarnessRequest:
    tasks = [t for names in (ns.tasks or []) for t in names.split(",") if t] or [TASK]
    rows = heldout_rows(ns, recipe) if TASK in tasks else []
    if TASK in tasks and not rows:
        raise DataError(f"the task {TASK} needs held-out rows: {ns.model} has no data.eval_sources; give them "
                        "with --rows FILE, or name other tasks with --tasks")
    max_new = ns.max_new_tokens or (recipe.get("eval") or {}).get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS
    return HarnessRequest(ns.model, base_of(ns, recipe), tasks, ns.include_path, rows, max_new, ns.limit,
                          ns.batch_size, ns.device, not ns.no_chat_template, ns.trust_remote_code)


def _evaluate(ns) -> int:
    recipe = run_recipe(ns.model)
    quantized_adapter_problem(ns.model, recipe)
    request = request_of(ns, recipe)
    comparisons = evaluate(request)
    output = ns.output or (os.path.join(ns.model, HARNESS_RESULTS_FILE) if recipe else None)
    if output:
        write_results(output, request, comparisons)
    if ns.min_delta is None:
        return 0
    if request.base is None:
        raise ModelError("--min-delta compares with the base model: give --base FOLDER (or evaluate a run folder)")
    failed = gate_messages(comparisons, ns.min_delta, "--min-delta")
    for message in failed:
        print(f"hftrain: {message}", file=sys.stderr)
    return GATE_FAILED if failed else 0


def add_eval_command(sub) -> None:
    ev = sub.add_parser("eval", allow_abbrev=False,
                        help="Benchmark a trained model against its base with lm-evaluation-harness (offline; the "
                             "run's held-out rows as the task hftrain_heldout, or any harness task).")
    ev.add_argument("model", help="a run's folder (training.output_dir: its base and held-out rows are read from its "
                                  "recipe.yaml), or any model folder")
    ev.add_argument("--base", help="the base model's folder (default: the run's model.name_or_path)")
    ev.add_argument("--no-base", dest="no_base", action="store_true", help="evaluate the model alone")
    ev.add_argument("--tasks", action="append",
                    help=f"harness tasks, comma-separated or repeated (default: {TASK}, the run's held-out rows)")
    ev.add_argument("--include-path", dest="include_path", help="a folder of your own harness task YAMLs")
    ev.add_argument("--rows", action="append", help=f"held-out rows for {TASK} (default: the run's data.eval_sources)")
    ev.add_argument("--max-new-tokens", dest="max_new_tokens", type=int,
                    help=f"{TASK}'s answer length (default: the run's eval.max_new_tokens, else 32)")
    ev.add_argument("--limit", type=int, help="evaluate the first N rows of each task only")
    ev.add_argument("--batch-size", dest="batch_size", type=int, default=8)
    ev.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:0, ...")
    ev.add_argument("--no-chat-template", dest="no_chat_template", action="store_true",
                    help="prompts as plain text, not through the model's chat template")
    ev.add_argument("--min-delta", dest="min_delta", type=float,
                    help="exit 1 when a metric improves on the base by less than this (negative: a regression allowed)")
    ev.add_argument("--output", help=f"where the table goes as JSON (default: the run folder's {HARNESS_RESULTS_FILE})")
    ev.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true",
                    help="allow the models' own code (off unless given)")
    ev.set_defaults(fn=_evaluate)
