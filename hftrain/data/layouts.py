"""Layouts: which kind of rows a source holds, and each row in canonical form. The canonical forms are the contract
with render.py:

    {"messages": [{"role", "content", "reasoning_content"?, "tool_calls"?, "name"?, "tool_call_id"?}, ...],
     "tools"?: list | None}
    {"prompt": str, "completion": str}
    {"text": str}

A message's content is text, or text parts [{"type": "text", "text": ...}] as the data gives them (render.py passes
each form to the template in the form it reads); reasoning_content is the message's reasoning (read from
reasoning_content, reasoning or thinking, or the field `columns:` names); a tool call's arguments are an object or
JSON text, as given; tools are in the OpenAI form {type: function, function: {...}} (bare {name, parameters, ...}
schemas are wrapped).

Every row is checked here, before any model is loaded: a problem names the recipe key, the file, the row in the
file's own numbering (see sources.py), what is wrong and the fix.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from ..config import DataSource
from ..distributed import print0
from ..errors import DataError
from .messages import MESSAGE_FIELDS, conversation, text_value, tools_list
from .sources import Rows, column_map, read_rows

LAYOUT_COLUMNS = {  # the columns that identify each layout (constants.DataLayout), tried in this order
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"


def detect_format(columns) -> str | None:
    columns = set(columns)
    for fmt, needed in LAYOUT_COLUMNS.items():
        if columns.issuperset(needed):
            return fmt
    return None



def read_canonical(src: DataSource, key: str, has_template: bool) -> tuple[str, list[tuple[str, dict]]]:
    """(layout, [(where, canonical example)]) for every row of a source; the first bad row stops with a DataError."""
    return canonicalise(read_rows(src, key), src, key, has_template)


def canonicalise(rows: Rows, src: DataSource, key: str, has_template: bool) -> tuple[str, list[tuple[str, dict]]]:
    """read_canonical for rows already read (into a list: for small sources, the tiny model's tokenizer, tests)."""
    fmt, rename, fields = source_layout(rows, src, key)
    out = [(where, canonical_row(row, fmt, rename, has_template, src.roles, key, where, fields))
           for where, row in rows.iterate()]
    # stderr: `hftrain check` prints the resolved recipe on stdout, as YAML to be read back
    print0(f"hftrain: {key} ({src.path}): layout {fmt}, {len(out)} rows", file=sys.stderr)
    return fmt, out


def source_layout(rows: Rows, src: DataSource, key: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """(the layout of a source's rows, the rename map of its `columns:`, the message fields `columns:` renames
    (hftrain's name -> the data's)): the layout detected from the columns of all its rows (a folder or glob whose
    files hold different layouts is refused naming them), or the one `format:` names."""
    fields = {ours: theirs for ours, theirs in src.columns.items() if ours in MESSAGE_FIELDS}
    rename = column_map(rows, replace(src, columns={k: v for k, v in src.columns.items() if k not in fields}), key)
    columns = [rename.get(c, c) for c in rows.columns]
    fmt = src.format
    if fmt == "auto":
        per_file = {name: detect_format([rename.get(c, c) for c in cols]) for name, cols in rows.part_columns}
        kinds = {f for f in per_file.values() if f is not None}
        if len(kinds) > 1:
            shown = ", ".join(f"{os.path.basename(name)} is {f}" for name, f in per_file.items() if f is not None)
            raise DataError(f"{key}.path: {src.path} mixes layouts ({shown}); put each layout in a source of its "
                            "own, or rewrite the files to one layout")
        fmt = detect_format(columns)
        if fmt is None:
            raise DataError(
                f"{key}.format: cannot detect the format of {src.path} from its columns {rows.columns}; expected "
                "messages, conversations (sharegpt), prompt+completion, instruction+output (alpaca) or text; "
                f"map yours with {key}.columns (e.g. {{prompt: question, completion: answer}}) or set {key}.format"
            )
    else:
        need = [c for c in LAYOUT_COLUMNS[fmt] if c not in columns]
        if need:
            raise DataError(
                f"{key}: format '{fmt}' needs column(s) {need}, {src.path} has {rows.columns}; "
                f"map them with {key}.columns"
            )
    if rows.count == 0:
        raise DataError(f"{key}.path: {src.path} has no examples")
    if fields and fmt in ("messages", "sharegpt"):
        _check_fields(rows, rename, LAYOUT_COLUMNS[fmt][0], fields, src, key)
    return fmt, rename, fields


def _check_fields(rows: Rows, rename: dict[str, str], col: str, fields: dict[str, str], src: DataSource,
                  key: str) -> None:
    """A `columns:` entry for a message field that no message of the source has is refused. The rows are read only
    until every named field is met (the first row, as a rule): a million-row source is read whole only to refuse."""
    unused = dict(fields)
    for _, row in rows.iterate():
        msgs = {rename.get(k, k): v for k, v in row.items()}.get(col)
        for m in msgs if isinstance(msgs, list) else []:
            if isinstance(m, dict):
                unused = {ours: theirs for ours, theirs in unused.items() if m.get(theirs) is None}
        if not unused:
            return
    raise DataError(f"{key}.columns: no message of {src.path} has the field(s) "
                    f"{sorted(unused.values())} ({', '.join(f'{o}: {t}' for o, t in unused.items())}); "
                    "fix the spelling or remove the entry")


def canonical_row(row: dict, fmt: str, rename: dict[str, str], has_template: bool, roles: dict[str, str], key: str,
                  where: str, fields: dict[str, str] | None = None) -> dict:
    """The canonical form of one row as read; a problem is a DataError naming the key and the row. `fields`: the
    message fields `columns:` renames (source_layout)."""
    row = {rename.get(k, k): v for k, v in row.items()} if rename else row
    try:
        _check_layout(row, fmt)
        return to_messages_or_text(row, fmt, has_template, roles, key, fields)
    except DataError as e:
        raise DataError(f"{key}: {where}: {e}") from None


def _check_layout(row: dict, fmt: str) -> None:
    """A row of another layout than its source's (a file mixing layouts) is refused as such, not as a missing column."""
    own = detect_format([k for k, v in row.items() if v is not None])
    if own is not None and own != fmt and all(row.get(c) is None for c in LAYOUT_COLUMNS[fmt]):
        raise DataError(f"mixed layouts: this row is {own} (columns {list(row)}), the source is {fmt}; put each "
                        "layout in a source of its own, or rewrite this row as the others")


def to_messages_or_text(example: dict, fmt: str, has_template: bool, roles: dict[str, str] | None = None,
                        key: str = "data.sources.<i>", fields: dict[str, str] | None = None,
                        seen: set | None = None) -> dict:
    """The canonical form of one row (see the module docstring); a problem raises DataError saying what and how to fix.

    `roles` maps the data's role names to hftrain's, `fields` message fields (hftrain's name -> the data's; `seen`
    collects the mapped ones met); alpaca rows become a conversation when the tokenizer has a chat template, else
    the Alpaca prompt."""
    roles = roles or {}
    if fmt in ("messages", "sharegpt"):
        col = LAYOUT_COLUMNS[fmt][0]
        names = {ours: (theirs,) for ours, theirs in (fields or {}).items()}
        msgs = conversation(_column(example, col, fmt), col, roles, key, fmt == "sharegpt",
                             {**MESSAGE_FIELDS, **names}, seen if seen is not None else set())
        system = example.get("system")
        if system is not None and text_value(system, "system") and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": system})
        return {"messages": msgs, **({"tools": tools_list(example["tools"])} if "tools" in example else {})}
    if fmt == "prompt_completion":
        return {"prompt": text_value(_column(example, "prompt", fmt), "prompt"),
                "completion": text_value(_column(example, "completion", fmt), "completion")}
    if fmt == "alpaca":
        return _alpaca(example, has_template)
    return {"text": text_value(_column(example, "text", fmt), "text")}


def _column(example: dict, col: str, fmt: str):
    if col not in example:
        raise DataError(f"no '{col}' column (the row has {list(example)}); every row of a {fmt} source needs it")
    return example[col]


def _alpaca(example: dict, has_template: bool) -> dict:
    instruction = text_value(_column(example, "instruction", "alpaca"), "instruction")
    output = text_value(_column(example, "output", "alpaca"), "output")
    inp = example.get("input")
    inp = text_value(inp, "input") if inp is not None else ""
    system = example.get("system")
    system = text_value(system, "system") if system is not None else ""
    history = example.get("history")
    if history is None:
        history = []
    if not isinstance(history, list):
        raise DataError(f"history is {type(history).__name__}; give a list of [user, assistant] pairs")
    turns = []
    for i, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise DataError(f"history[{i}] is {json.dumps(pair, default=str)[:80]}; each turn before the last is a "
                            "[user, assistant] pair")
        turns.append((text_value(pair[0], f"history[{i}][0]"), text_value(pair[1], f"history[{i}][1]")))
    if has_template:
        msgs = [{"role": "system", "content": system}] if system else []
        for user, assistant in turns:
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        user = instruction + (f"\n\n{inp}" if inp else "")
        return {"messages": msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]}
    before = (f"{system}\n\n" if system else "") + "".join(
        ALPACA_PROMPT.format(instruction=u, input_block="") + f"{a}\n\n" for u, a in turns)
    block = f"### Input:\n{inp}\n\n" if inp else ""
    return {"prompt": before + ALPACA_PROMPT.format(instruction=instruction, input_block=block), "completion": output}
