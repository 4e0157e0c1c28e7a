"""Layouts: which kind of rows a source holds, and each row in canonical form. The canonical forms are the contract
with render.py:

    {"messages": [{"role", "content", "tool_calls"?, "name"?, "tool_call_id"?}, ...], "tools"?: list | None}
    {"prompt": str, "completion": str}
    {"text": str}

Every row is checked here, before any model is loaded: a problem names the recipe key, the file, the row in the
file's own numbering (see sources.py), what is wrong and the fix.
"""

from __future__ import annotations

import json
import os
import sys
from ..config import DataSource
from ..constants import ROLE_TARGETS, ROLES
from ..distributed import print0
from ..errors import DataError
from .sources import Rows, column_map, read_rows

LAYOUT_COLUMNS = {  # the columns that identify each layout (constants.DataLayout), tried in this order
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "observation": "tool", "function": "tool"}
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
    fmt, rename = source_layout(rows, src, key)
    out = [(where, canonical_row(row, fmt, rename, has_template, src.roles, key, where)) for where, row in rows.iterate()]
    # stderr: `hftrain check` prints the resolved recipe on stdout, as YAML to be read back
    print0(f"hftrain: {key} ({src.path}): layout {fmt}, {len(out)} rows", file=sys.stderr)
    return fmt, out


def source_layout(rows: Rows, src: DataSource, key: str) -> tuple[str, dict[str, str]]:
    """(the layout of a source's rows, the rename map of its `columns:`): detected from the columns of all its rows
    (a folder or glob whose files hold different layouts is refused naming them), or the one `format:` names."""
    rename = column_map(rows, src, key)
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
    return fmt, rename


def canonical_row(row: dict, fmt: str, rename: dict[str, str], has_template: bool, roles: dict[str, str], key: str,
                  where: str) -> dict:
    """The canonical form of one row as read; a problem is a DataError naming the key and the row."""
    row = {rename.get(k, k): v for k, v in row.items()} if rename else row
    try:
        _check_layout(row, fmt)
        return to_messages_or_text(row, fmt, has_template, roles, key)
    except DataError as e:
        raise DataError(f"{key}: {where}: {e}") from None


def _check_layout(row: dict, fmt: str) -> None:
    """A row of another layout than its source's (a file mixing layouts) is refused as such, not as a missing column."""
    own = detect_format([k for k, v in row.items() if v is not None])
    if own is not None and own != fmt and all(row.get(c) is None for c in LAYOUT_COLUMNS[fmt]):
        raise DataError(f"mixed layouts: this row is {own} (columns {list(row)}), the source is {fmt}; put each "
                        "layout in a source of its own, or rewrite this row as the others")


def to_messages_or_text(example: dict, fmt: str, has_template: bool, roles: dict[str, str] | None = None,
                        key: str = "data.sources.<i>") -> dict:
    """The canonical form of one row (see the module docstring); a problem raises DataError saying what and how to fix.

    `roles` maps the data's role names to hftrain's; alpaca rows become a conversation when the tokenizer has a chat
    template, else the Alpaca prompt."""
    roles = roles or {}
    if fmt in ("messages", "sharegpt"):
        col = LAYOUT_COLUMNS[fmt][0]
        msgs = _conversation(_column(example, col, fmt), col, roles, key, sharegpt=fmt == "sharegpt")
        system = example.get("system")
        if system is not None and _text(system, "system") and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": system})
        return {"messages": msgs, **({"tools": _tools(example["tools"])} if "tools" in example else {})}
    if fmt == "prompt_completion":
        return {"prompt": _text(_column(example, "prompt", fmt), "prompt"),
                "completion": _text(_column(example, "completion", fmt), "completion")}
    if fmt == "alpaca":
        return _alpaca(example, has_template)
    return {"text": _text(_column(example, "text", fmt), "text")}


def _column(example: dict, col: str, fmt: str):
    if col not in example:
        raise DataError(f"no '{col}' column (the row has {list(example)}); every row of a {fmt} source needs it")
    return example[col]


def _text(value, what: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        raise DataError(f"{what} is null where text is expected; give it a string (\"\" if empty) or drop the row")
    if isinstance(value, (int, float)):
        raise DataError(f"{what} is a number ({value!r}) where text is expected; quote it in the file (\"{value}\")")
    raise DataError(f"{what} is {type(value).__name__} {json.dumps(value, default=str)[:80]} where text is expected; "
                    "give it a string")


def _content(value, what: str) -> str:
    """Text, or OpenAI content parts [{type: text, text}, ...] joined as written."""
    if not isinstance(value, list):
        return _text(value, what)
    parts = []
    for i, part in enumerate(value):
        if not (isinstance(part, dict) and part.get("type", "text") == "text" and "text" in part):
            raise DataError(f"{what}[{i}] is not a text part ({json.dumps(part, default=str)[:80]}); only "
                            "{\"type\": \"text\", \"text\": ...} parts can be trained on: remove the others")
        parts.append(_text(part["text"], f"{what}[{i}].text"))
    return "".join(parts)


def _conversation(msgs, col: str, roles: dict[str, str], key: str, sharegpt: bool) -> list[dict]:
    if isinstance(msgs, str):
        raise DataError(f"'{col}' is a string, not a list of messages; store it as a JSON list of "
                        "{\"role\": ..., \"content\": ...} objects, not as JSON text inside a string")
    if msgs is None or not isinstance(msgs, list):
        raise DataError(f"'{col}' is {'null' if msgs is None else type(msgs).__name__}, not a list of messages; give "
                        "each row a list of {\"role\": ..., \"content\": ...} objects")
    if not msgs:
        raise DataError(f"empty conversation ('{col}' is []); give the row its turns or remove it")
    out: list[dict] = []
    for j, m in enumerate(msgs):
        out.append(_message(m, f"{col}[{j}]", roles, key, sharegpt, out[-1] if out else None))
    return out


def _message(m, what: str, roles: dict[str, str], key: str, sharegpt: bool, previous: dict | None) -> dict:
    if not isinstance(m, dict):
        raise DataError(f"{what} is {type(m).__name__}, not a message object; write it as "
                        "{\"role\": ..., \"content\": ...}")
    role_key = "role" if m.get("role") is not None else "from"
    if m.get(role_key) is None:
        raise DataError(f"{what} has no role (keys {list(m)}); give every message a 'role' (or ShareGPT 'from')")
    theirs = _text(m[role_key], f"{what}.{role_key}")
    # ShareGPT's role names hold in its layout, and for {from, value} messages mapped to `messages` by columns.
    role = roles.get(theirs, SHAREGPT_ROLES.get(theirs, theirs) if sharegpt or role_key == "from" else theirs)
    if role not in ROLE_TARGETS:
        raise DataError(f"{what}: unknown role '{theirs}'; map it with {key}.roles (e.g. {{{theirs}: assistant}}) "
                        f"to one of {', '.join(ROLES)} (or function_call, an assistant's tool call as JSON text)")
    content_key = "content" if "content" in m else "value"
    if role == "function_call":
        return {"role": "assistant", "content": "", "tool_calls": _function_call(m.get(content_key), what)}
    calls = m.get("tool_calls")
    if content_key not in m or (m[content_key] is None and not calls):
        raise DataError(f"{what} ({role}) has no content (keys {list(m)}); give it a 'content' (or ShareGPT "
                        "'value'), \"\" if empty")
    out = {"role": role, "content": "" if m[content_key] is None else _content(m[content_key], f"{what}.content")}
    if calls:
        if role != "assistant":
            raise DataError(f"{what}: only assistant messages carry tool_calls, this one is {role}; fix its role")
        if not isinstance(calls, list):
            raise DataError(f"{what}.tool_calls is {type(calls).__name__}; give a list of "
                            "{\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": {...}}}")
        out["tool_calls"] = [_tool_call(c, f"{what}.tool_calls[{i}]") for i, c in enumerate(calls)]
    if role == "tool":
        for field in ("name", "tool_call_id"):
            if m.get(field) is not None:
                out[field] = _text(m[field], f"{what}.{field}")
        calls = (previous or {}).get("tool_calls") or []
        if "name" not in out and len(calls) == 1:  # ShareGPT observations answer the call just before them
            out["name"] = calls[0]["function"]["name"]
    return out


def _function_call(value, what: str) -> list[dict]:
    """A ShareGPT function_call turn: JSON text {"name", "arguments"} (or a list of them) -> tool_calls."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{what} is a function_call whose value is not JSON ({e.msg}): {value[:80]!r}; write it "
                            "as JSON text {\"name\": ..., \"arguments\": {...}}") from None
    calls = value if isinstance(value, list) else [value]
    return [_tool_call(c, f"{what}.value") for c in calls]


def _tool_call(call, what: str) -> dict:
    """{type: function, function: {name, arguments: dict}} from the OpenAI form or a bare {name, arguments}."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise DataError(f"{what} is not a tool call ({json.dumps(call, default=str)[:80]}); write it as "
                        "{\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": {...}}}")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise DataError(f"{what}.arguments is a string that is not JSON ({e.msg}): {args[:80]!r}; give an "
                            "object, or JSON text of one") from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise DataError(f"{what}.arguments is {type(args).__name__} {json.dumps(args, default=str)[:80]}; give an "
                        "object of named arguments")
    return {"type": "function", "function": {"name": _text(fn.get("name"), f"{what}.name"), "arguments": args}}


def _tools(value) -> list[dict] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as e:
            raise DataError(f"tools is a string that is not JSON ({e.msg}): {value[:80]!r}; give a list of tool "
                            "schemas, or JSON text of one") from None
    if value is not None and not (isinstance(value, list) and all(isinstance(t, dict) for t in value)):
        raise DataError(f"tools is {json.dumps(value, default=str)[:80]}; give a list of tool schemas "
                        "({\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}})")
    return value


def _alpaca(example: dict, has_template: bool) -> dict:
    instruction = _text(_column(example, "instruction", "alpaca"), "instruction")
    output = _text(_column(example, "output", "alpaca"), "output")
    inp = example.get("input")
    inp = _text(inp, "input") if inp is not None else ""
    system = example.get("system")
    system = _text(system, "system") if system is not None else ""
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
        turns.append((_text(pair[0], f"history[{i}][0]"), _text(pair[1], f"history[{i}][1]")))
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
