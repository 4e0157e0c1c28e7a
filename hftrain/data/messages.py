"""A conversation's messages in canonical form (layouts.py's contract with render.py): roles mapped, content as text or
text parts, reasoning read from the field the data names it by, tool calls and tool schemas in the OpenAI form. Each
problem raises DataError saying what is wrong and the fix; layouts.py adds the file and row."""

from __future__ import annotations

import json

from ..constants import ROLE_TARGETS, ROLES
from ..errors import DataError

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "observation": "tool", "function": "tool"}
# Message fields, and the spellings datasets use for them (first found wins); `columns:` may name another
# (e.g. {reasoning_content: cot}): a `columns` entry for one of these renames a key of every message, not a column.
MESSAGE_FIELDS = {"reasoning_content": ("reasoning_content", "reasoning", "thinking")}


def text_value(value, what: str) -> str:
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
        return text_value(value, what)
    parts = []
    for i, part in enumerate(value):
        if not (isinstance(part, dict) and part.get("type", "text") == "text" and "text" in part):
            raise DataError(f"{what}[{i}] is not a text part ({json.dumps(part, default=str)[:80]}); only "
                            "{\"type\": \"text\", \"text\": ...} parts can be trained on: remove the others")
        parts.append({"type": "text", "text": text_value(part["text"], f"{what}[{i}].text")})
    return parts


def content_text(content) -> str:
    """A canonical content as one string (parts joined as written)."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def conversation(msgs, col: str, roles: dict[str, str], key: str, sharegpt: bool, fields: dict,
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
    text = text_value(value, f"{what}.{name}")
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
    theirs = text_value(m[role_key], f"{what}.{role_key}")
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
                out[field] = text_value(m[field], f"{what}.{field}")
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
    out = {"type": "function", "function": {"name": text_value(fn.get("name"), f"{what}.name"), "arguments": args}}
    if isinstance(call, dict) and call.get("id") is not None:
        out["id"] = text_value(call["id"], f"{what}.id")
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


def tools_list(value) -> list[dict] | None:
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
