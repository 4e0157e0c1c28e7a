"""A process reward model's data phase: stepwise-supervision rows, as TRL's earlier PRMTrainer named them
(`{"prompt": str, "completions": [step, ...], "labels": [bool, ...]}`; the prompt may be a list of messages, rendered
with the chat template and its generation prompt), checked row by row and tokenised before the model loads.

The text of a row is the prompt followed by each step and the step separator (reward.step_separator), the last step
included, as TRL's trainer built it (with the tokenizer's BOS before a text prompt). Only the separator token at each
step's end carries the step's label (1 correct, 0 not); every other token is -100. TRL tokenised each step on its
own and appended the separator's ids: the ids it trained on were not those of the joined text a user scores later
whenever the tokenizer merges across a step's edges. Here the joined text is tokenised once, and each separator must
be exactly one token of it (found by the tokenizer's character offsets): a separator the tokenizer splits into
several tokens or merges with neighbouring text has no one position to label, and is refused naming the separator,
what it tokenises to, and the row. TRL has no such check, nor any of the row checks below: they are written here.
A row longer than data.max_length is left out (counted and named: cutting it would drop its last steps' labels);
none left is an error naming data.max_length."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import datasets

from ...config import Recipe
from ...data.gather import PLACE, gather_sources
from ...data.sources import column_map, read_rows
from ...distributed import print0
from ...errors import DataError
from ..base import has_template
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


def separator_tokens(tokenizer, separator: str) -> list[str]:
    return tokenizer.convert_ids_to_tokens(tokenizer.encode(separator, add_special_tokens=False))


def separator_problem(tokenizer, separator: str) -> str | None:
    """Why `separator` cannot mark a step's end with this tokenizer (it is not one token), or None."""
    if not getattr(tokenizer, "is_fast", False):
        return ("reward.step_separator: finding each step's end needs a fast tokenizer (character offsets); "
                f"{type(tokenizer).__name__} is not one: save the model with its tokenizers-backed tokenizer")
    tokens = separator_tokens(tokenizer, separator)
    if len(tokens) != 1:
        return (f"reward.step_separator: {separator!r} tokenises to {len(tokens)} tokens {tokens}, so a step's end "
                "has no one token to label: choose a separator that is a single token (e.g. '\\n')")
    return None


def pad_problem(tokenizer, key: str) -> str | None:
    """hftrain's tokenizer pads with EOS, else UNK, when it has no pad token (modeling.load_tokenizer); with none of
    them a batch of rows of different lengths cannot be padded."""
    if tokenizer.pad_token_id is None:
        return (f"{key}: the tokenizer has no pad, eos or unk token to pad a batch of step rows with: add a pad token "
                "(tokenizer.add_special_tokens({'pad_token': ...})) and save it again")
    return None


def rendered_prompt(prompt, tokenizer, template_kwargs: dict) -> tuple[str, list[int]]:
    """(text, ids before it): a text prompt after the tokenizer's BOS (as TRL's PRMTrainer), a conversation rendered
    with the chat template and its generation prompt (the template writes its own special tokens)."""
    if isinstance(prompt, str):
        return prompt, [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    try:
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                             **template_kwargs), []
    except Exception as e:  # noqa: BLE001 - the template's own refusal (jinja raise_exception), named by row
        raise DataError(f"the chat template refuses the prompt: {type(e).__name__}: {e}") from None


def separator_token(enc, text: str, start: int, end: int) -> int | None:
    """The index of the one token whose characters are exactly text[start:end] (the separator), else None."""
    token = enc.char_to_token(start)
    return token if token is not None and tuple(enc.offset_mapping[token]) == (start, end) else None


def tokenised_steps(row: dict, tokenizer, separator: str, template_kwargs: dict) -> dict:
    """One checked row as ids: the prompt, then each step followed by the separator, tokenised as one text; each
    step's end is its separator's token (step_ends), with the step's label (step_labels, 1 or 0)."""
    head, before = rendered_prompt(row["prompt"], tokenizer, template_kwargs)
    text, spans = head, []
    for i, step in enumerate(row["completions"]):
        if separator in step:
            raise DataError(f"completions[{i}]: holds the step separator {separator!r}, so the text would read as "
                            "more steps than it has labels: join the step's lines otherwise, or choose another "
                            "reward.step_separator")
        text += step + separator
        spans.append((len(text) - len(separator), len(text)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ends = []
    for i, (start, end) in enumerate(spans):
        token = separator_token(enc, text, start, end)
        if token is None:
            near = enc.char_to_token(start)
            cut = tuple(enc.offset_mapping[near]) if near is not None else (start, end)
            said = tokenizer.convert_ids_to_tokens([enc.input_ids[near]]) if near is not None else "no token"
            raise DataError(f"completions[{i}]: the step separator {separator!r} merges with neighbouring text: "
                            f"{text[cut[0]:cut[1]]!r} tokenises to {said}, so the step's end has no token of its own "
                            "to label: choose a reward.step_separator the tokenizer keeps apart (e.g. '\\n')")
        ends.append(token + len(before))
    first = enc.char_to_token(len(head))
    return {"input_ids": before + enc.input_ids, "prompt_tokens": len(before) + (first if first is not None else 0),
            "step_ends": ends, "step_labels": [int(label) for label in row["labels"]]}


def _named(bad: list[str], key: str) -> str:
    more = [f"{key}: and {len(bad) - SHOWN} more rows like these"] if len(bad) > SHOWN else []
    return "\n".join(bad[:SHOWN] + more)


def within_max_length(rows: list[dict], places: list[str], max_length: int | None, key: str, path: str):
    """The rows of one source that fit data.max_length: longer ones are left out and named (cutting one would lose
    its last steps' labels); none left is a DataError naming data.max_length."""
    too_long = {i for i, r in enumerate(rows) if max_length is not None and len(r["input_ids"]) > max_length}
    if len(too_long) == len(rows):
        shortest = min(len(r["input_ids"]) for r in rows)
        raise DataError(f"{key}: every one of the {len(rows)} step rows of {path} is longer than data.max_length="
                        f"{max_length} tokens, and cutting a row would lose its last steps' labels (the shortest has "
                        f"{shortest} tokens); raise data.max_length to {shortest} or more")
    if too_long:
        shown = [places[i] for i in sorted(too_long)]
        print0(f"hftrain: {key}: {len(too_long)} of {len(rows)} step rows of {path} are left out: longer than "
               f"data.max_length={max_length} tokens ({', '.join(shown[:5])}"
               f"{f' and {len(shown) - 5} more' if len(shown) > 5 else ''}); raise data.max_length to keep them",
               file=sys.stderr)
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
    weight (data.gather); the separator and pad-token problems and every bad row are refused together."""
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

    gathered = gather_sources(recipe.data, seed,
                              lambda src, key, group: read_step_source(src, key, recipe, tokenizer, templated),
                              measured)
    held = datasets.concatenate_datasets(gathered.held) if gathered.held else None
    return StepData(gathered.train, held)


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
