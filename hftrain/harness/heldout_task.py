"""A run's held-out conversations as an lm-evaluation-harness task: the user's message through the model's chat
template (the harness's --apply_chat_template), the answer generated greedily until the end of the turn (the saved
generation_config's end-of-turn ids) or eval.max_new_tokens, scored by exact match with surrounding whitespace
ignored, as hftrain's own eval.exact_match counts it (evaluate.py). Written as a task folder the harness reads
(--include-path), pointing at the rows' files by absolute path."""

from __future__ import annotations

import json
import os

import yaml

from ..errors import DataError

TASK = "hftrain_heldout"
ONE_TURN = ["user", "assistant"]


def _row_problem(row) -> str | None:
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or [m.get("role") if isinstance(m, dict) else None
                                          for m in messages] != ONE_TURN:
        return "not one user message then the assistant's answer (`messages: [user, assistant]`)"
    if not all(isinstance(m.get("content"), str) for m in messages):
        return "a message's content is not text"
    return None


def checked_rows(path: str) -> int:
    """The number of rows of a held-out file, each a one-turn conversation; a DataError names the first bad row."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file (the held-out rows of the task {TASK}: give them with --rows FILE)")
    count = 0
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                problem = _row_problem(json.loads(line))
            except json.JSONDecodeError as e:
                problem = f"malformed JSON ({e.msg})"
            if problem:
                raise DataError(f"{path}:{line_number}: {problem}; the task {TASK} takes one-turn conversations: "
                                "give other rows with --rows, or another task with --tasks and --include-path")
            count += 1
    if count == 0:
        raise DataError(f"{path}: no rows (the task {TASK} needs held-out conversations)")
    return count


def task_config(paths: list[str], max_new_tokens: int) -> dict:
    return {
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": [os.path.abspath(p) for p in paths]}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{messages[0].content}}",
        "doc_to_target": "{{messages[1].content}}",
        "generation_kwargs": {"until": [], "max_gen_toks": max_new_tokens, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "regexes_to_ignore": [r"^\s+", r"\s+$"]}],
    }


def write_heldout_task(folder: str, paths: list[str], max_new_tokens: int) -> int:
    """The task's YAML in `folder` (a task folder for --include-path); returns the rows it holds."""
    rows = sum(checked_rows(p) for p in paths)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{TASK}.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(task_config(paths, max_new_tokens), f, sort_keys=False)
    return rows
