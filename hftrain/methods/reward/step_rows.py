"""A process reward model's data phase: stepwise-supervision rows, as TRL's earlier PRMTrainer named them
(`{"prompt": str, "completions": [step, ...], "labels": [bool, ...]}`; the prompt may be a list of messages, rendered
with the chat template and its generation prompt), checked row by row and tokenised before the model loads.

A row is read as methods/reward_reading.py reads a prompt and its steps, the one contract GRPO's scoring shares: the
prompt, then each step tokenised alone and followed by the separator's one token (reward.step_separator), as TRL's
trainer built its rows. Only the separator token at each step's end carries the step's label (1 correct, 0 not);
every other token is -100. A separator that is not one token by itself is refused naming what it tokenises to; a
step holding the separator is refused by row. TRL has no such checks, nor any of the row checks below: they are
written here. A row longer than data.max_length is left out (counted and named: cutting it would drop its last
steps' labels); none left is an error naming data.max_length."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import datasets

from ...config import Recipe
from ...data.source_loop import PLACE, read_sources
from ...data.sources import column_map, read_rows
from ...data.left_out import none_left, say_left_out
from ...distributed import print0
from ...errors import DataError
from ..base import has_template
from .. import reward_reading
from ..pairs import messages_of

IGNORED = -100  # the label of every token that is not a step's end
COLUMNS = ("prompt", "completions", "labels")
SHOWN = 10  # bad rows named in one message


@dataclass
class StepData:
    train: Any  # datasets.Dataset of input_ids, prompt_tokens, step_ends, step_labels
    eval: Any | None


def steps_of_row(row: dict, roles: dict[str, str]) -> dict:
    """The checked row {prompt, completions, labels}; a DataError names the column (and step) and the fix."""
    missing = [c for c in COLUMNS if row.get(c) is None]
    if missing:
        raise DataError(f"no {' or '.join(repr(c) for c in missing)} column (the row has {list(row)}); a step row "
                        "needs prompt, completions (the steps) and labels (one true/false per step); map yours with "
                        "columns:")
    prompt, steps, labels = row["prompt"], row["completions"], row["labels"]
    prompt = prompt if isinstance(prompt, str) else messages_of(prompt, "prompt", roles)
    if not isinstance(steps, list) or not steps:
        raise DataError(f"'completions' must be a non-empty list of steps (text), got {str(steps)[:60]}")
    if not isinstance(labels, list):
        raise DataError(f"'labels' must be a list of true/false, one per step, got {str(labels)[:60]}")
    for i, step in enumerate(steps):
        if not isinstance(step, str) or not step.strip():
            raise DataError(f"completions[{i}]: a step must be non-empty text, got {str(step)[:60]!r}; fix or remove "
                            "the step")
    if len(labels) != len(steps):
        raise DataError(f"{len(steps)} steps but {len(labels)} labels: each step needs exactly one label")
    for i, label in enumerate(labels):
        if not isinstance(label, bool):
            raise DataError(f"labels[{i}]: must be true or false (is the step correct), got {str(label)[:40]!r}")
    return {"prompt": prompt, "completions": steps, "labels": labels}


def separator_problem(tokenizer, separator: str) -> str | None:
    """Why `separator` cannot mark a step's end with this tokenizer (methods/reward_reading.py), or None."""
    problem = reward_reading.separator_problem(tokenizer, separator)
    return f"reward.step_separator: {problem}" if problem else None


def pad_problem(tokenizer, key: str) -> str | None:
    """hftrain's tokenizer pads with EOS, else UNK, when it has no pad token (modeling.load_tokenizer); with none of
    them a batch of rows of different lengths cannot be padded."""
    if tokenizer.pad_token_id is None:
        return (f"{key}: the tokenizer has no pad, eos or unk token to pad a batch of step rows with: add a pad token "
                "(tokenizer.add_special_tokens({'pad_token': ...})) and save it again")
    return None


def tokenised_steps(row: dict, tokenizer, separator: str, template_kwargs: dict) -> dict:
    """One checked row as ids, as methods/reward_reading.py reads a prompt and its steps (GRPO's scoring reads a
    rollout the same way); each step's end is its separator's token (step_ends), with the step's label
    (step_labels, 1 or 0)."""
    for i, step in enumerate(row["completions"]):
        if separator in step:
            raise DataError(f"completions[{i}]: holds the step separator {separator!r}, so the text would read as "
                            "more steps than it has labels: join the step's lines otherwise, or choose another "
                            "reward.step_separator")
    return {**reward_reading.step_row(row["prompt"], row["completions"], tokenizer, separator, template_kwargs),
            "step_labels": [int(label) for label in row["labels"]]}


def _named(bad: list[str], key: str) -> str:
    more = [f"{key}: and {len(bad) - SHOWN} more rows like these"] if len(bad) > SHOWN else []
    return "\n".join(bad[:SHOWN] + more)


def within_max_length(rows: list[dict], places: list[str], max_length: int | None, key: str, path: str):
    """The rows of one source that fit data.max_length: longer ones are left out and named (cutting one would lose
    its last steps' labels); none left is a DataError naming data.max_length."""
    too_long = {i for i, r in enumerate(rows) if max_length is not None and len(r["input_ids"]) > max_length}
    if len(too_long) == len(rows):
        shortest = min(len(r["input_ids"]) for r in rows)
        raise none_left(key, path, len(rows), "step rows",
                        f"is longer than data.max_length={max_length} tokens, and cutting a row would lose its last "
                        f"steps' labels (the shortest has {shortest} tokens)",
                        f"raise data.max_length to {shortest} or more")
    say_left_out(key, path, [places[i] for i in sorted(too_long)], len(rows), "step rows",
                 f"longer than data.max_length={max_length} tokens")
    return datasets.Dataset.from_list([r for i, r in enumerate(rows) if i not in too_long])


def read_step_source(src, key: str, recipe: Recipe, tokenizer, templated: bool):
    """Every row of one source checked (all bad rows named at once, by file and row) and, with a `tokenizer`,
    tokenised, each with its place (measured against data.max_length after the held-out split); without one (a
    problem already found) the rows are only checked and None is returned."""
    rows = read_rows(src, key)
    rename = column_map(rows, src, key)
    if rows.count == 0:
        raise DataError(f"{key}.path: {src.path} has no examples")
    out, places, bad = [], [], []
    template_kwargs = recipe.data.chat_template_kwargs or {}
    for where, row in rows.iterate():
        try:
            steps = steps_of_row({rename.get(k, k): v for k, v in row.items()}, src.roles)
            if not isinstance(steps["prompt"], str) and not templated:
                raise DataError("the prompt is a conversation and the tokenizer has no chat template: set "
                                "data.chat_template (a Jinja string or a .jinja file)")
            if tokenizer is not None:
                out.append(tokenised_steps(steps, tokenizer, recipe.reward.step_separator, template_kwargs))
                places.append(where)
        except DataError as e:
            bad.append(f"{key}: {where}: {e}")
    if bad:
        raise DataError(_named(bad, key))
    print0(f"hftrain: {key} ({src.path}): layout steps, {rows.count} rows", file=sys.stderr)
    return datasets.Dataset.from_list(out).add_column(PLACE, places) if tokenizer is not None else None


def build_step_data(recipe: Recipe, tokenizer, seed: int) -> StepData:
    """Every source's rows checked and tokenised, held out (data.eval_fraction, data.eval_sources) and mixed by
    weight (data.source_loop); the separator and pad-token problems and every bad row are refused together."""
    where = "model.tokenizer_name_or_path" if recipe.model.tokenizer_name_or_path else "model.name_or_path"
    problems = [p for p in (separator_problem(tokenizer, recipe.reward.step_separator), pad_problem(tokenizer, where))
                if p]
    templated = has_template(tokenizer)
    if problems:  # the rows are still read and checked, so that check names everything at once
        found = list(problems)
        d = recipe.data
        for key, src in [(f"data.sources.{i}", s) for i, s in enumerate(d.sources)] + [
                (f"data.eval_sources.{i}", s) for i, s in enumerate(d.eval_sources)]:
            try:
                read_step_source(src, key, recipe, None, templated)
            except DataError as e:
                found.append(str(e))
        raise DataError("\n".join(found))
    def measured(rows, key: str, src) -> datasets.Dataset:
        """After the held-out split: which rows are held out never depends on data.max_length."""
        return within_max_length(rows.remove_columns(PLACE).to_list(), rows[PLACE], recipe.data.max_length, key,
                                 src.path)

    split = read_sources(recipe.data, seed,
                         lambda src, key, group: read_step_source(src, key, recipe, tokenizer, templated), measured)
    held = datasets.concatenate_datasets(split.held) if split.held else None
    return StepData(split.train, held)


def labelled(rows, last_step_only: bool):
    """input_ids and labels: each step's label at its separator token, -100 elsewhere; `last_step_only`: only the
    last step's (reward.train_on_last_step_only, training rows only, as TRL's PRMTrainer)."""
    def one(row):
        labels = [IGNORED] * len(row["input_ids"])
        last = len(row["step_ends"]) - 1
        for j, (end, label) in enumerate(zip(row["step_ends"], row["step_labels"])):
            if not last_step_only or j == last:
                labels[end] = label
        return {"input_ids": row["input_ids"], "labels": labels}
    return rows.map(one, remove_columns=rows.column_names)


def read_step_rows(recipe: Recipe, tokenizer, world_size: int, seed: int) -> StepData:
    """The run's rows as the trainer takes them (input_ids, labels); held-out rows keep every step's label, so the
    held-out step accuracy and F1 judge every step."""
    data = build_step_data(recipe, tokenizer, seed)
    evald = labelled(data.eval, False) if data.eval is not None else None
    return StepData(labelled(data.train, recipe.reward.train_on_last_step_only), evald)


def show_steps(recipe: Recipe, tokenizer, n: int) -> str:
    """The first n training rows as `hftrain data` shows them: the prompt, each step (with its separator) and its
    label and length in tokens, one JSON object per row."""
    data = build_step_data(recipe, tokenizer, recipe.typed_training.seed)
    rows = data.train.select(range(min(n, len(data.train))))
    print(f"hftrain: the first {len(rows)} training step rows (each step with its separator, whose token carries "
          "the label)", file=sys.stderr)
    lines = []
    for row in rows:
        ids, start, steps = row["input_ids"], row["prompt_tokens"], []
        for end, label in zip(row["step_ends"], row["step_labels"]):
            steps.append({"step": tokenizer.decode(ids[start:end + 1]), "label": bool(label),
                          "tokens": end + 1 - start})
            start = end + 1
        lines.append(json.dumps({"prompt": tokenizer.decode(ids[:row["prompt_tokens"]]),
                                 "prompt_tokens": row["prompt_tokens"], "steps": steps, "tokens": len(ids)},
                                ensure_ascii=False))
    return "\n".join(lines)
