"""Layouts: which columns a source has, and each row in canonical form ({'messages': [...]}, {'prompt', 'completion'}
or {'text'})."""

from __future__ import annotations

from ..config import DataSource
from ..errors import DataError

FORMAT_COLUMNS = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"


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


