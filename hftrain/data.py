"""Data: load sources, detect their format, tokenise with loss masks, mix, split, collate (optionally packed).

Loss masks come from character spans: a token is trainable when it overlaps the trainable part of the rendered text
(assistant turns, the completion, or everything; fast tokenizers' offsets). This works with any prefix-stable chat
template, where transformers' `return_assistant_tokens_mask` needs `{% generation %}` markers most templates lack.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import datasets
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

from .config import DataSection, DataSource
from .constants import IGNORE_INDEX
from .distributed import main_process_first
from .errors import DataError

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
FORMAT_COLUMNS = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"


@dataclass
class Datasets:
    train: Any
    eval: Any | None
    collator: Callable
    eval_examples: list[dict]  # canonical held-out examples (prompt + reference) for generation metrics


# ----------------------------------------------------------------------------------------------------------------
# Loading


def _where(key: str, src: DataSource) -> str:
    return f"{key} ({src.path})"


def load_source(src: DataSource, key: str):
    """A `datasets.Dataset` for one source: local file(s), a save_to_disk folder, or a Hub id."""
    path = src.path
    looks_local = path.startswith((".", "/", "~")) or os.path.splitext(path)[1].lower() in FILE_BUILDERS
    path = os.path.expanduser(path)
    try:
        if os.path.isdir(path) and (
            os.path.exists(os.path.join(path, "dataset_info.json"))
            or os.path.exists(os.path.join(path, "dataset_dict.json"))
        ):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if src.split not in ds:
                    raise DataError(f"{key}.split: '{src.split}' not in {path} (splits: {', '.join(ds)})")
                ds = ds[src.split]
            return ds
        files = sorted(glob.glob(path)) if any(c in path for c in "*?[") else ([path] if os.path.isfile(path) else [])
        if files:
            exts = {os.path.splitext(f)[1].lower() for f in files}
            if len(exts) != 1 or next(iter(exts)) not in FILE_BUILDERS:
                raise DataError(
                    f"{key}.path: cannot read {path}: use .jsonl, .json, .parquet or .csv files (found {sorted(exts)})"
                )
            for f in files:
                if os.path.getsize(f) == 0:
                    raise DataError(f"{key}.path: {f} is empty; fill it or remove this source")
            _check_utf8_json_lines(files, key)
            return datasets.load_dataset(FILE_BUILDERS[exts.pop()], data_files=files, split="train")
        if looks_local or os.path.isdir(path):
            if os.path.isdir(path):
                return datasets.load_dataset(path, name=src.name, split=src.split)
            raise DataError(f"{key}.path: {path} does not exist (a local path; check the spelling or the working directory)")
        return datasets.load_dataset(path, name=src.name, split=src.split)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types; say which source failed and why
        raise DataError(f"{key}.path: cannot load {path}: {type(e).__name__}: {e}") from e


def _check_utf8_json_lines(files: list[str], key: str) -> None:
    """Name the file and line of a malformed JSONL row or a non-UTF-8 byte (datasets' own error names neither)."""
    for f in files:
        if not f.lower().endswith(".jsonl"):
            continue
        with open(f, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{key}.path: {f}:{n}: not UTF-8 ({e.reason} at byte {e.start})") from None
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{key}.path: {f}:{n}: malformed JSON: {e.msg} (column {e.colno})") from None


def detect_format(columns: list[str]) -> str | None:
    for fmt in ("messages", "prompt_completion", "alpaca", "text"):
        if all(c in columns for c in FORMAT_COLUMNS[fmt]):
            return fmt
    return None


def prepare_columns(ds, src: DataSource, key: str):
    """Rename the user's columns to hftrain's names and settle the format."""
    rename = {theirs: ours for ours, theirs in src.columns.items()}
    missing = [c for c in rename if c not in ds.column_names]
    if missing:
        raise DataError(f"{key}.columns: {missing} not in {src.path} (columns: {ds.column_names})")
    if rename:
        ds = ds.rename_columns(rename)
    fmt = src.format
    if fmt == "auto":
        fmt = detect_format(ds.column_names)
        if fmt is None:
            raise DataError(
                f"{key}.format: cannot detect the format of {src.path} from its columns {ds.column_names}; "
                "expected messages, prompt+completion, instruction+output (alpaca) or text; "
                f"map yours with {key}.columns (e.g. {{messages: conversations}}) or set {key}.format"
            )
    else:
        need = [c for c in FORMAT_COLUMNS[fmt] if c not in ds.column_names]
        if need:
            raise DataError(
                f"{key}: format '{fmt}' needs column(s) {need}, {src.path} has {ds.column_names}; "
                f"map them with {key}.columns"
            )
    if len(ds) == 0:
        raise DataError(f"{key}.path: {src.path} has no examples")
    return ds, fmt


# ----------------------------------------------------------------------------------------------------------------
# Canonical examples -> rendered text + trainable character spans


def to_messages_or_text(example: dict, fmt: str, has_template: bool) -> dict:
    """Canonical form: {'messages': [...]} or {'prompt': str, 'completion': str} or {'text': str}."""
    if fmt == "messages":
        return {"messages": example["messages"]}
    if fmt == "prompt_completion":
        return {"prompt": example["prompt"], "completion": example["completion"]}
    if fmt == "alpaca":
        inp = example.get("input") or ""
        if has_template:
            user = example["instruction"] + (f"\n\n{inp}" if inp else "")
            return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": example["output"]}]}
        block = f"### Input:\n{inp}\n\n" if inp else ""
        return {"prompt": ALPACA_PROMPT.format(instruction=example["instruction"], input_block=block), "completion": example["output"]}
    return {"text": example["text"]}


def render(canon: dict, tokenizer, train_on_prompt: bool) -> tuple[str, list[tuple[int, int]], bool]:
    """(text, trainable char spans, add_special_tokens) for one canonical example."""
    if "messages" in canon:
        msgs = canon["messages"]
        full = tokenizer.apply_chat_template(msgs, tokenize=False)
        if train_on_prompt:
            return full, [(0, len(full))], False
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            start = tokenizer.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True) if i else ""
            end = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=False)
            if not (full.startswith(start) and full.startswith(end)):
                raise DataError(
                    "the chat template is not prefix-stable (rendering the first turns alone differs from the start "
                    "of the whole conversation), so assistant tokens cannot be located; set data.chat_template to a "
                    "template that renders turns independently, or data.assistant_only_loss: false"
                )
            spans.append((len(start), len(end)))
        return full, spans, False
    eos = tokenizer.eos_token or ""
    if "prompt" in canon:
        text = canon["prompt"] + canon["completion"] + eos
        return text, [(0 if train_on_prompt else len(canon["prompt"]), len(text))], True
    text = canon["text"] + eos
    return text, [(0, len(text))], True


def tokenize_example(canon: dict, tokenizer, train_on_prompt: bool) -> dict:
    text, spans, special = render(canon, tokenizer, train_on_prompt)
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids = enc["input_ids"]
    # A token is trainable when its characters overlap a trainable span. Overlap, not "starts inside": a BPE token
    # may merge the template's trailing space with the answer's first letter (" c" after "assistant:"), and
    # that token is the answer's first. Zero-width special tokens (an added BOS) never are.
    labels = [
        tok if b > a and any(a < e and b > s for s, e in spans) else IGNORE_INDEX
        for tok, (a, b) in zip(ids, enc["offset_mapping"])
    ]
    return {"input_ids": ids, "labels": labels}


def trainable_tokens(labels: list[int]) -> int:
    """Tokens that contribute to the loss after the causal shift (what the Trainer counts)."""
    return sum(1 for x in labels[1:] if x != IGNORE_INDEX)


# ----------------------------------------------------------------------------------------------------------------
# Building


def _tokenize_source(ds, fmt: str, tokenizer, cfg: DataSection, key: str, src: DataSource):
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if fmt in ("messages",) and not has_template:
        raise DataError(
            f"{key}: messages need a chat template and the tokenizer has none; set data.chat_template "
            "(a Jinja string or a .jinja file)"
        )
    train_on_prompt = {
        "messages": not cfg.assistant_only_loss,
        "alpaca": not (cfg.assistant_only_loss if has_template else cfg.completion_only_loss),
        "prompt_completion": not cfg.completion_only_loss,
        "text": True,
    }[fmt]
    max_length, drop = cfg.max_length, cfg.truncation == "drop"

    def fn(example, idx):
        out = tokenize_example(to_messages_or_text(example, fmt, has_template), tokenizer, train_on_prompt)
        n = len(out["input_ids"])
        if not drop:
            out = {k: v[:max_length] for k, v in out.items()}
        out["too_long"] = n > max_length
        out["n_trainable"] = trainable_tokens(out["labels"])
        out["row"] = idx
        return out

    with main_process_first():
        tok = ds.map(
            fn,
            with_indices=True,
            remove_columns=ds.column_names,
            num_proc=cfg.num_proc,
            desc=f"Tokenising {src.path}",
        )
    if drop:
        tok = tok.filter(lambda r: not r, input_columns="too_long")
        if len(tok) == 0:
            raise DataError(f"{key}: every example of {src.path} is longer than data.max_length={max_length}; "
                            "raise data.max_length, or set data.truncation: right to cut them")
    bad = [r for r, n in zip(tok["row"], tok["n_trainable"]) if n == 0]
    if bad:
        if not cfg.skip_untrainable:
            shown = ", ".join(str(b) for b in bad[:5]) + (" ..." if len(bad) > 5 else "")
            raise DataError(
                f"{key}: {len(bad)} of {len(tok)} examples of {src.path} have no trainable token (rows {shown}; "
                f"0-based) after masking and truncation to data.max_length={max_length}. Raise data.max_length, "
                "fix those rows, or set data.skip_untrainable: true to drop them"
            )
        tok = tok.filter(lambda n: n > 0, input_columns="n_trainable")
        if len(tok) == 0:
            raise DataError(f"{key}: no example of {src.path} has a trainable token")
    return tok.remove_columns(["too_long", "n_trainable", "row"])


def _canonical_eval(ds, fmt: str, has_template: bool, n: int) -> list[dict]:
    """Held-out examples split into what the model sees and the reference answer."""
    out = []
    for ex in ds.select(range(min(n, len(ds)))):
        canon = to_messages_or_text(ex, fmt, has_template)
        if "messages" in canon and canon["messages"] and canon["messages"][-1]["role"] == "assistant":
            out.append({"messages": canon["messages"][:-1], "reference": canon["messages"][-1]["content"]})
        elif "prompt" in canon:
            out.append({"prompt": canon["prompt"], "reference": canon["completion"]})
    return out


def build_datasets(cfg: DataSection, tokenizer, seed: int = 42, exact_match: int = 0) -> Datasets:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    train_parts, eval_parts, weights, eval_examples = [], [], [], []
    for i, src in enumerate(cfg.sources):
        key = f"data.sources.{i}"
        ds, fmt = prepare_columns(load_source(src, key), src, key)
        if cfg.eval_fraction > 0:
            split = ds.train_test_split(test_size=cfg.eval_fraction, seed=seed)
            ds, held = split["train"], split["test"]
            eval_parts.append(_tokenize_source(held, fmt, tokenizer, cfg, key, src))
            eval_examples += _canonical_eval(held, fmt, has_template, exact_match)
        train_parts.append(_tokenize_source(ds, fmt, tokenizer, cfg, key, src))
        weights.append(src.weight)
    for i, src in enumerate(cfg.eval_sources):
        key = f"data.eval_sources.{i}"
        ds, fmt = prepare_columns(load_source(src, key), src, key)
        eval_parts.append(_tokenize_source(ds, fmt, tokenizer, cfg, key, src))
        eval_examples += _canonical_eval(ds, fmt, has_template, exact_match - len(eval_examples))
    train = mix(train_parts, weights, seed)
    evald = datasets.concatenate_datasets(eval_parts) if eval_parts else None
    return Datasets(train, evald, make_collator(tokenizer, cfg.packing), eval_examples[:exact_match])


def mix(parts: list, weights: list[float], seed: int):
    """One source as is; several interleaved with probabilities proportional to their weights, until every source
    has been seen whole (datasets' `all_exhausted`)."""
    if len(parts) == 1:
        return parts[0]
    total = sum(weights)
    return datasets.interleave_datasets(
        parts, probabilities=[w / total for w in weights], seed=seed, stopping_strategy="all_exhausted"
    )


def make_collator(tokenizer, packing: bool):
    if packing:
        # One row per batch, position_ids restarting at 0 for each example: the attention mask built from them
        # is block-diagonal, so packed examples never attend to each other; the first label of each is -100.
        return DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX)
    if tokenizer.pad_token_id is None:
        raise DataError(
            "the tokenizer has no pad token; batching without packing needs one (set data.packing: true, or use a "
            "tokenizer with a pad token)"
        )
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
