"""Rules of a recipe's data section: sources, templates, lengths, preparation and streaming. Each problem is (key as
the user spells it, message with the fix); rules.py runs them with the other sections' rules.
"""

from __future__ import annotations

import math

from ..constants import ROLE_TARGETS
from .fields import is_number
from .sections import DataSource, Problems, Recipe

_num = is_number


def _chat_template_problem(template) -> str | None:
    """A chat_template value that is neither template text nor a .jinja file would be used as the template."""
    if not isinstance(template, str) or template.endswith(".jinja") or "{{" in template or "{%" in template:
        return None
    if template.startswith("trl:"):  # one TRL ships (modeling.chat_template_file)
        return None
    return (f"{template!r} is neither a Jinja template (no {{{{ or {{%) nor a .jinja file: give the path of a .jinja "
            "file, trl:NAME for a template TRL ships, or the template text itself")


def data_problems(recipe: Recipe, out: Problems) -> bool:
    """Rules of the data section; returns whether the recipe has held-out data."""
    d = recipe.data
    if d is None:
        return False
    if isinstance(d.sources, list) and len(d.sources) == 0:
        out.append(("data.sources", "needs at least one source, e.g. [{path: data/train.jsonl}]"))
    if _num(d.eval_fraction) and not 0.0 <= d.eval_fraction < 1.0:
        out.append(("data.eval_fraction", f"must be in [0, 1), got {d.eval_fraction}"))
    if _num(d.eval_fraction) and d.eval_fraction > 0 and d.eval_sources:
        out.append(("data.eval_fraction", "set either data.eval_fraction or data.eval_sources, not both"))
    problem = _chat_template_problem(d.chat_template)
    if problem:
        out.append(("data.chat_template", problem))
    if d.train_turns == "last" and d.assistant_only_loss is False:
        out.append(("data.train_turns", "'last' picks the assistant turn to train, and data.assistant_only_loss: "
                    "false trains every token of the conversation: remove one of them"))
    if _num(d.max_length) and d.max_length < 2:
        out.append(("data.max_length", f"must be at least 2, got {d.max_length}"))
    if _num(d.num_proc) and d.num_proc < 1:
        out.append(("data.num_proc", f"must be at least 1 (or unset: the cores available), got {d.num_proc}"))
    _streaming_problems(recipe, out)
    weights = []
    for i, s in enumerate(d.sources if isinstance(d.sources, list) else []):
        if isinstance(s, DataSource) and _num(s.weight) and not (math.isfinite(s.weight) and s.weight > 0):
            out.append((f"data.sources.{i}.weight", f"must be a finite number > 0, got {s.weight}"))
        elif isinstance(s, DataSource) and _num(s.weight):
            weights.append(s.weight)
    if len(weights) > 1 and not math.isfinite(sum(weights)):
        out.append(("data.sources", f"the weights add up to more than a float holds ({', '.join(map(str, weights))}): "
                    "they are relative, scale them down (e.g. to 1 and 2)"))
    for i, s in enumerate(d.eval_sources if isinstance(d.eval_sources, list) else []):
        if isinstance(s, DataSource) and s.weight != 1.0:
            out.append((f"data.eval_sources.{i}.weight", "held-out sources are each evaluated whole, never sampled by "
                        "weight: remove it (weights mix data.sources)"))
    for group in ("sources", "eval_sources"):
        for i, s in enumerate(getattr(d, group) if isinstance(getattr(d, group), list) else []):
            for theirs, ours in (s.roles.items() if isinstance(s, DataSource) and isinstance(s.roles, dict) else ()):
                if ours not in ROLE_TARGETS:
                    out.append((f"data.{group}.{i}.roles.{theirs}", f"unknown role '{ours}': map {theirs} to one of "
                                f"{', '.join(ROLE_TARGETS)}"))
    return (_num(d.eval_fraction) and d.eval_fraction > 0) or bool(d.eval_sources)


def _streaming_problems(recipe: Recipe, out: Problems) -> None:
    """data.streaming: a stream has no length (max_steps), holds nothing out, and keeps its position in the
    training process (no dataloader workers)."""
    d, t = recipe.data, recipe.training
    if _num(d.shuffle_buffer) and d.shuffle_buffer < 1:
        out.append(("data.shuffle_buffer", f"must be at least 1, got {d.shuffle_buffer}"))
    if d.streaming is not True:
        if d.shuffle_buffer is not None:
            out.append(("data.shuffle_buffer", "applies to data.streaming: true only (prepared data is shuffled "
                        "whole): remove it, or set data.streaming: true"))
        if d.on_stream_change != "refuse":
            out.append(("data.on_stream_change", "applies to data.streaming: true only (prepared data is read whole "
                        "and keyed on its files' content): remove it, or set data.streaming: true"))
        return
    steps = t.get("max_steps")
    if not (_num(steps) and steps > 0):
        out.append(("training.max_steps", "data.streaming needs training.max_steps > 0: a stream has no length to "
                    "count epochs in"))
    if _num(d.eval_fraction) and d.eval_fraction > 0:
        out.append(("data.eval_fraction", "cannot hold rows out of a stream: give held-out data in "
                    "data.eval_sources (prepared, not streamed), or set data.streaming: false"))
    workers = t.get("dataloader_num_workers")
    if _num(workers) and workers > 0:
        out.append(("training.dataloader_num_workers", "must be 0 with data.streaming: the stream's position, which "
                    "a checkpoint records, lives in the training process (rows are tokenised there as they come)"))
