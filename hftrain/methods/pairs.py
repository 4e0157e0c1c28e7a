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

import math
import sys
from dataclasses import dataclass
from typing import Any

import datasets

from ..config import DataSection, DataSource
from ..constants import ROLES
from ..distributed import print0
from ..errors import DataError
from ..data.sources import column_map, read_rows
from ..data.left_out import first_places, none_left, say_left_out
from ..data.source_loop import PLACE, read_sources
from ..vision.image_pairs import decoded

PAIR = ("chosen", "rejected")


@dataclass
class PreferenceData:
    train: Any  # datasets.Dataset of prompt / chosen / rejected (text, or lists of messages), TRL's input layout
    eval: Any | None
    conversational: bool
    collator: Any = None  # the batches' collator where the trainer's own is not it (image pairs: modality.py)
    processor: Any = None  # the trainer's processing class where it is not the tokenizer (an image model's processor)


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
    missing = [c for c in PAIR if c not in row]
    if missing:
        raise DataError(f"no {' or '.join(repr(c) for c in missing)} column (the row has {list(row)}); a preference "
                        "row needs prompt, chosen and rejected (map yours with columns:, e.g. {chosen: good})")
    empty = [c for c in PAIR if row[c] is None]
    if empty:
        raise DataError(f"{' and '.join(repr(c) for c in empty)} is null: a pair needs an answer on both sides; fix "
                        "or remove the row")
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


def numbers_of(row: dict, keep: tuple[str, ...]) -> dict:
    """The columns `keep` of a row (a reward model's margin), each a finite number; a DataError names the column."""
    out = {}
    for column in keep:
        value = row.get(column)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataError(f"column {column!r} must hold a finite number, got {str(value)[:40]}")
        out[column] = float(value)
    return out


def read_pairs(src: DataSource, key: str, with_rows: bool = False, keep: tuple[str, ...] = ()):
    """The pair of every row of a source, and whether they are conversations (and, `with_rows`, each pair's row in
    the file's own numbering); the first bad row stops. `keep`: number columns carried beside the pair."""
    rows = read_rows(src, key)
    rename = column_map(rows, src, key)
    if rows.count == 0:
        raise DataError(f"{key}.path: {src.path} has no examples")
    pairs, kinds, places = [], {}, []
    for where, row in rows.iterate():
        try:
            named = {rename.get(k, k): v for k, v in row.items()}
            pair = {**pair_of_row(named, src.roles), **numbers_of(named, keep)}
        except DataError as e:
            raise DataError(f"{key}: {where}: {e}") from None
        kind = isinstance(pair["chosen"], list)
        kinds.setdefault(kind, where)
        if len(kinds) > 1:
            raise DataError(f"{key}: {where}: is {'a conversation' if kind else 'text'} but {kinds[not kind]} is "
                            f"{'text' if kind else 'a conversation'}; put each kind in a source of its own")
        pairs.append(pair)
        places.append(where)
    print0(f"hftrain: {key} ({src.path}): layout preference ({'conversations' if kinds.get(True) else 'text'}), "
           f"{len(pairs)} pairs", file=sys.stderr)
    return (pairs, bool(kinds.get(True)), places) if with_rows else (pairs, bool(kinds.get(True)))


ROW = "__hftrain_row"  # a pair's position in its source while TRL's tokenisation runs (removed after)


def trl_prepared(ds, tokenizer, max_length: int | None, name: str = "preference"):
    """The pairs as TRL 1.16's DPOTrainer will prepare them at data.max_length: its own DPOTrainer._prepare_dataset
    (prompt extraction, EOS for text pairs, tokenising prompt, prompt + chosen and prompt + rejected with the chat
    template, and dropping every pair whose prompt alone fills max_length, which keep_start truncation would leave
    with no answer token). Called rather than re-written, so that the count here is TRL's; the method reads only the
    tokenizer's EOS of its trainer, given here. The prepared rows keep ROW, their index in `ds`."""
    from types import SimpleNamespace

    from trl import DPOTrainer  # heavy import: preference runs only

    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start")
    indexed = ds.add_column(ROW, list(range(len(ds))))
    return DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tokenizer), indexed, tokenizer, args, name)


def check_lengths(ds, places: list[str], tokenizer, max_length: int, key: str, path: str):
    """The pairs of one source that truncation to data.max_length leaves something to train on: a pair whose prompt
    fills max_length (TRL drops it) is counted and left out here, before the model loads; none left is a DataError
    naming data.max_length; pairs whose two answers are the same within max_length (they differ only after the cut,
    so the pair states no preference) are counted. Both counts are printed with the first rows."""
    prepared = trl_prepared(ds, tokenizer, max_length, key)
    kept = prepared[ROW]
    dropped = sorted(set(range(len(ds))) - set(kept))
    if not kept:
        shortest = min(len(ids) for ids in trl_prepared(ds, tokenizer, None, key)["prompt_ids"])
        raise none_left(key, path, len(ds), "pairs",
                        f"has a prompt of data.max_length={max_length} tokens or more, so truncation would leave none "
                        f"of their answers to train on (the shortest prompt has {shortest} tokens)",
                        f"raise data.max_length above {shortest}")
    say_left_out(key, path, [places[i] for i in dropped], len(ds), "pairs",
                 f"their prompt alone fills data.max_length={max_length} tokens, so nothing of their answers would be "
                 "trained")
    same = [places[r] for r, p, c, j in zip(kept, prepared["prompt_ids"], prepared["chosen_ids"],
                                            prepared["rejected_ids"])
            if c[:max_length - len(p)] == j[:max_length - len(p)]]
    if same:
        print0(f"hftrain: {key}: {len(same)} of {len(ds)} pairs of {path} have the same chosen and rejected tokens "
               f"within data.max_length={max_length} (they differ only after the cut): they state no preference "
               f"({first_places(same)}); raise data.max_length", file=sys.stderr)
    return ds.select(kept) if dropped else ds


class ImagePairs:
    """The collator of pairs with images: TRL's DataCollatorForVisionPreference (its rendering with the processor's
    chat template, padding and cut at max_length), given each row decoded by hftrain (vision/image_pairs.py: images
    decoded by images.open_rgb, never raw)."""

    def __init__(self, processor, max_length: int):
        from trl.trainer.dpo_trainer import DataCollatorForVisionPreference  # heavy: runs on pairs only

        self.batch = DataCollatorForVisionPreference(processor=processor, max_length=max_length)

    def __call__(self, rows: list[dict]) -> dict:
        return self.batch([decoded(row) for row in rows])


def check_kind(kinds: dict, key: str, conversational: bool, has_template: bool, what: str) -> None:
    """One kind of row in a run (conversations or text: TRL's trainers take one), and a chat template for
    conversations. `kinds` maps each kind seen to the first source holding it (updated here)."""
    kinds.setdefault(conversational, key)
    if len(kinds) > 1:
        raise DataError(f"{key}: holds {'conversations' if conversational else 'text'} {what} but "
                        f"{kinds[not conversational]} holds the other kind; use one kind in a run")
    if conversational and not has_template:
        raise DataError(f"{key}: conversation {what} need a chat template and the tokenizer has none; set "
                        "data.chat_template (a Jinja string or a .jinja file)")


def build_preference_data(cfg: DataSection, has_template: bool, seed: int = 42, tokenizer=None,
                          measure=check_lengths, keep: tuple[str, ...] = ()) -> PreferenceData:
    """Every source read and checked, held-out pairs split off (data.eval_fraction) or read (data.eval_sources),
    the training sources mixed by weight. With the run's `tokenizer`, each source's pairs are also measured as the
    method's TRL trainer will cut them (`measure`: DPO's truncation, check_lengths), before any model is loaded.
    `keep`: number columns carried beside each pair (numbers_of)."""
    kinds: dict = {}

    def read(src: DataSource, key: str, group: str) -> datasets.Dataset:
        pairs, conversational, places = read_pairs(src, key, with_rows=True, keep=keep)
        check_kind(kinds, key, conversational, has_template, "pairs")
        if conversational and cfg.chat_template_kwargs:  # TRL passes a row's chat_template_kwargs to the template
            pairs = [{**p, "chat_template_kwargs": cfg.chat_template_kwargs} for p in pairs]
        ds = datasets.Dataset.from_list(pairs)
        return ds if tokenizer is None else ds.add_column(PLACE, places)

    def finish(ds: datasets.Dataset, key: str, src: DataSource) -> datasets.Dataset:
        """Measured after the held-out split: which pairs are held out never depends on data.max_length."""
        if tokenizer is None:
            return ds
        return measure(ds.remove_columns(PLACE), ds[PLACE], tokenizer, cfg.max_length, key, src.path)

    split = read_sources(cfg, seed, read, finish)
    evald = datasets.concatenate_datasets(split.held) if split.held else None
    return PreferenceData(split.train, evald, bool(kinds.get(True)))
