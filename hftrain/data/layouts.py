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


# Message fields, and the spellings datasets use for them (first found wins); `columns:` may name another
# (e.g. {reasoning_content: cot}): a `columns` entry for one of these renames a key of every message, not a column.
MESSAGE_FIELDS = {"reasoning_content": ("reasoning_content", "reasoning", "thinking")}


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
        msgs = _conversation(_column(example, col, fmt), col, roles, key, fmt == "sharegpt",
                             {**MESSAGE_FIELDS, **names}, seen if seen is not None else set())
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


def _content(value, what: str) -> str | list[dict]:
    """Text, or OpenAI content parts kept as parts: [{"type": "text", "text": ...}, ...] (render.py flattens them for
    a template that reads text only)."""
    if not isinstance(value, list):
        return _text(value, what)
    parts = []
    for i, part in enumerate(value):
        if not (isinstance(part, dict) and part.get("type", "text") == "text" and "text" in part):
            raise DataError(f"{what}[{i}] is not a text part ({json.dumps(part, default=str)[:80]}); only "
                            "{\"type\": \"text\", \"text\": ...} parts can be trained on: remove the others")
        parts.append({"type": "text", "text": _text(part["text"], f"{what}[{i}].text")})
    return parts


def content_text(content) -> str:
    """A canonical content as one string (parts joined as written)."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def _conversation(msgs, col: str, roles: dict[str, str], key: str, sharegpt: bool, fields: dict,
                  seen: set) -> list[dict]:
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
        out.append(_message(m, f"{col}[{j}]", roles, key, sharegpt, out[-1] if out else None, fields, seen))
    return out


def _reasoning(m: dict, what: str, role: str, names: tuple[str, ...], seen: set) -> str | None:
    """The message's reasoning, under whichever of `names` it has (at most one of them, with text)."""
    found = [(n, m[n]) for n in names if m.get(n) is not None]
    if not found:
        return None
    seen.update(n for n, _ in found)
    if len(found) > 1:
        raise DataError(f"{what} has reasoning under {[n for n, _ in found]}; keep one of them")
    name, value = found[0]
    text = _text(value, f"{what}.{name}")
    if role != "assistant" and text:
        raise DataError(f"{what}: only assistant messages carry reasoning, this one is {role}; remove its {name}")
    return text


def _message(m, what: str, roles: dict[str, str], key: str, sharegpt: bool, previous: dict | None,
             fields: dict | None = None, seen: set | None = None) -> dict:
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
    reasoning = _reasoning(m, what, role, (fields or MESSAGE_FIELDS)["reasoning_content"],
                           seen if seen is not None else set())
    if reasoning:
        out["reasoning_content"] = reasoning
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
    """{type: function, function: {name, arguments}} (and the call's id when it has one) from the OpenAI form or a
    bare {name, arguments}. Arguments stay as given, an object or JSON text of one (render.py hands the template the
    form it reads)."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise DataError(f"{what} is not a tool call ({json.dumps(call, default=str)[:80]}); write it as "
                        "{\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": {...}}}")
    args = fn.get("arguments")
    parsed = args
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise DataError(f"{what}.arguments is a string that is not JSON ({e.msg}): {args[:80]!r}; give an "
                            "object, or JSON text of one") from None
        args = args if args.strip() else "{}"
    if args is None:
        args = parsed = {}
    if not isinstance(parsed, dict):
        raise DataError(f"{what}.arguments is {type(parsed).__name__} {json.dumps(parsed, default=str)[:80]}; give "
                        "an object of named arguments")
    out = {"type": "function", "function": {"name": _text(fn.get("name"), f"{what}.name"), "arguments": args}}
    if isinstance(call, dict) and call.get("id") is not None:
        out["id"] = _text(call["id"], f"{what}.id")
    return out


def _tool(tool, what: str) -> dict:
    """A tool schema in the OpenAI form; a bare {name, description?, parameters?} is wrapped in it."""
    if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
        return tool
    if isinstance(tool, dict) and isinstance(tool.get("name"), str):
        return {"type": "function", "function": tool}
    raise DataError(f"{what} is {json.dumps(tool, default=str)[:80]}; give a tool schema "
                    + '({"type": "function", "function": {"name": ..., "parameters": {...}}} or '
                    + '{"name": ..., "parameters": {...}})')


def _tools(value) -> list[dict] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as e:
            raise DataError(f"tools is a string that is not JSON ({e.msg}): {value[:80]!r}; give a list of tool "
                            "schemas, or JSON text of one") from None
    if value is None:
        return None
    if not isinstance(value, list):
        raise DataError(f"tools is {json.dumps(value, default=str)[:80]}; give a list of tool schemas "
                        "({\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}})")
    return [_tool(t, f"tools[{i}]") for i, t in enumerate(value)]


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
