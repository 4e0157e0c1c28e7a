"""Preference pairs: rows of prompt / chosen / rejected, checked row by row before any model is loaded.

A row is either text (`{"prompt": "2+2=", "chosen": "4", "rejected": "5"}`) or a conversation: `prompt` a list of
messages and `chosen` / `rejected` the assistant turn(s) that answer it, or (no `prompt` column) `chosen` and
`rejected` as whole conversations that share their first turns, the prompt. Conversations are rendered with the
tokenizer's chat template (or data.chat_template) and data.chat_template_kwargs, the prompt with the generation
prompt, exactly as supervised fine-tuning renders them; text rows are prompt + answer + EOS, as SFT's
prompt_completion. Tokenising is TRL's (DPOTrainer._prepare_dataset); what TRL does not do is refuse a bad row by
name, and a pair whose sides are equal (no preference) or empty would train on noise: that is done here, naming
the file and row in the file's own numbering (data/sources.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import datasets

from ..config import DataSection, DataSource
from ..constants import ROLES
from ..distributed import print0
from ..errors import DataError
from .build import mix
from .sources import column_map, read_rows

PAIR = ("chosen", "rejected")


@dataclass
class PreferenceData:
    train: Any  # datasets.Dataset of prompt / chosen / rejected (text, or lists of messages), TRL's input layout
    eval: Any | None
    conversational: bool


def messages_of(value, what: str, roles: dict[str, str]) -> list[dict]:
    if not isinstance(value, list):
        raise DataError(f"{what}: expected a list of messages, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{what}[{i}]: a message needs a text 'role' and 'content', got {str(m)[:80]}")
        role = roles.get(m["role"], m["role"])
        if role not in ROLES:
            raise DataError(f"{what}[{i}]: unknown role '{m['role']}'; map it with roles: (e.g. {{{m['role']}: "
                            f"assistant}}) to one of {', '.join(ROLES)}")
        out.append({"role": role, "content": m["content"]})
    return out


def is_empty(side) -> bool:
    if isinstance(side, str):
        return not side.strip()
    return not side or all(not m["content"].strip() for m in side)


def pair_of_row(row: dict, roles: dict[str, str]) -> dict:
    """The canonical pair of one row ({prompt, chosen, rejected}); a DataError says what is wrong and the fix."""
    missing = [c for c in PAIR if c not in row or row[c] is None]
    if missing:
        raise DataError(f"no {' or '.join(repr(c) for c in missing)} column (the row has {list(row)}); a preference "
                        "row needs prompt, chosen and rejected (map yours with columns:, e.g. {chosen: good})")
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    text = [isinstance(v, str) for v in (chosen, rejected)] + ([isinstance(prompt, str)] if prompt is not None else [])
    if all(text):
        if prompt is None:
            raise DataError("text chosen/rejected need a 'prompt' column (the text both answer)")
        pair = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    elif any(text):
        raise DataError("mixes text and message lists among prompt/chosen/rejected; write all three as text, or "
                        "all as lists of messages")
    else:
        chosen, rejected = messages_of(chosen, "chosen", roles), messages_of(rejected, "rejected", roles)
        if prompt is None:  # whole conversations: the prompt is the turns they share before the first answer
            n = 0
            while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
                n += 1
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
            if not prompt:
                raise DataError("chosen and rejected share no first turns, and there is no 'prompt' column: give the "
                                "prompt turns in 'prompt', or begin both conversations with them")
        else:
            prompt = messages_of(prompt, "prompt", roles)
        for side, msgs in (("chosen", chosen), ("rejected", rejected)):
            if msgs and msgs[0]["role"] != "assistant":
                raise DataError(f"{side} must begin with the assistant's answer (role assistant), got role "
                                f"'{msgs[0]['role']}'")
        pair = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    for side in PAIR:
        if is_empty(pair[side]):
            raise DataError(f"{side} is empty: a pair needs an answer on both sides; fix or remove the row")
    if pair["chosen"] == pair["rejected"]:
        raise DataError("chosen equals rejected: the pair states no preference; fix or remove the row")
    return pair


def read_pairs(src: DataSource, key: str) -> tuple[list[dict], bool]:
    """The pair of every row of a source, and whether they are conversations; the first bad row stops."""
    rows = read_rows(src, key)
    rename = column_map(rows, src, key)
    if rows.count == 0:
        raise DataError(f"{key}.path: {src.path} has no examples")
    pairs, kinds = [], {}
    for where, row in rows.iterate():
        try:
            pair = pair_of_row({rename.get(k, k): v for k, v in row.items()}, src.roles)
        except DataError as e:
            raise DataError(f"{key}: {where}: {e}") from None
        kind = isinstance(pair["chosen"], list)
        kinds.setdefault(kind, where)
        if len(kinds) > 1:
            raise DataError(f"{key}: {where}: is {'a conversation' if kind else 'text'} but {kinds[not kind]} is "
                            f"{'text' if kind else 'a conversation'}; put each kind in a source of its own")
        pairs.append(pair)
    print0(f"hftrain: {key} ({src.path}): layout preference ({'conversations' if kinds.get(True) else 'text'}), "
           f"{len(pairs)} pairs", file=sys.stderr)
    return pairs, bool(kinds.get(True))


def build_preference_data(cfg: DataSection, has_template: bool, seed: int = 42) -> PreferenceData:
    """Every source read and checked, held-out pairs split off (data.eval_fraction) or read (data.eval_sources),
    the training sources mixed by weight."""
    train_parts, eval_parts, weights, kinds = [], [], [], {}
    groups = [("sources", s, i) for i, s in enumerate(cfg.sources)] + [
        ("eval_sources", s, i) for i, s in enumerate(cfg.eval_sources)]
    for group, src, i in groups:
        key = f"data.{group}.{i}"
        pairs, conversational = read_pairs(src, key)
        kinds.setdefault(conversational, key)
        if len(kinds) > 1:
            raise DataError(f"{key}: holds {'conversations' if conversational else 'text'} pairs but "
                            f"{kinds[not conversational]} holds the other kind; use one kind in a run")
        if conversational and not has_template:
            raise DataError(f"{key}: conversation pairs need a chat template and the tokenizer has none; set "
                            "data.chat_template (a Jinja string or a .jinja file)")
        if conversational and cfg.chat_template_kwargs:  # TRL passes a row's chat_template_kwargs to the template
            pairs = [{**p, "chat_template_kwargs": cfg.chat_template_kwargs} for p in pairs]
        ds = datasets.Dataset.from_list(pairs)
        if group == "eval_sources":
            eval_parts.append(ds)
            continue
        if cfg.eval_fraction > 0:
            split = ds.train_test_split(test_size=cfg.eval_fraction, seed=seed)
            ds = split["train"]
            eval_parts.append(split["test"])
        train_parts.append(ds)
        weights.append(src.weight)
    evald = datasets.concatenate_datasets(eval_parts) if eval_parts else None
    return PreferenceData(mix(train_parts, weights, seed), evald, bool(kinds.get(True)))
