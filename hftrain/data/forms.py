"""What a chat template reads, found by rendering small probe conversations once per template (and
data.chat_template_kwargs), never from the template's name or a table of families:

- in which form it takes each role's content: text, or content parts [{"type": "text", "text": ...}] (vision
  templates read parts only and write a string as nothing; most text templates add strings and fail on parts);
- under which message field it writes an assistant's reasoning (reasoning_content, reasoning or thinking);
- whether it takes a tool call's arguments as an object or as JSON text (DeepSeek's templates concatenate strings,
  most others write the object with tojson and would write JSON text quoted a second time);
- what it writes right after an assistant turn when a user message or a tool result follows (GLM-4-MoE ends a turn
  with nothing, the next role's token follows: that token is what the model generates to stop);
- its generation prompt after a user message: how it opens an assistant turn (<|im_start|>assistant\n).

template_messages then hands a canonical conversation to the template in the forms it reads: content parts kept
where the template iterates over them and joined where it cannot, arguments as given where the template takes that
form and converted where it takes only the other, reasoning under the template's own field name. transformers has
no such introspection (apply_chat_template passes messages through as given), hence this module."""

from __future__ import annotations

import json
from dataclasses import dataclass

from jinja2.exceptions import TemplateError

from ..errors import DataError

# What a template (or the data it is handed) can raise: raise_exception's TemplateError, and the TypeError /
# KeyError / ... of a template that meets a message shape it does not expect (a dict where it adds strings).
TEMPLATE_ERRORS = (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)

# Words that appear in a rendering only when the template writes the probe's field.
WORD = {"system": "hftrainsys", "user": "hftrainuser", "assistant": "hftrainreply", "tool": "hftrainresult"}
REASONING_WORD, NEXT_WORD, FN, KEY, VALUE = "hftrainthought", "hftrainnext", "hftrain_fn", "hftrain_key", "hftrain_val"
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")  # the names templates read reasoning under
# What a rendering shows when a template writes a Python object instead of reading it: a list of parts, arguments.
REPR = ("'type': 'text'", '"type": "text"', f"'{KEY}'", f'\\"{KEY}')
_cache: dict = {}


@dataclass(frozen=True)
class Forms:
    content: dict  # role -> the forms ("text", "parts") in which the template writes that role's content
    reasoning: str | None  # the message field the template writes an assistant's reasoning from
    arguments: tuple[str, ...]  # the forms ("object", "string") in which it writes a tool call's arguments
    after_turn: str  # what it writes after an assistant turn when a user message follows
    after_call: str  # ... after an assistant turn with tool calls, when the tool result follows
    turn_header: str  # its generation prompt after a user message (how it opens an assistant turn)


def _render(tokenizer, msgs: list[dict], kwargs: dict, tools=None, add_generation_prompt: bool = False) -> str | None:
    try:
        return tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
    except TEMPLATE_ERRORS:
        return None


def _written(text: str | None, word: str) -> bool:
    return text is not None and word in text and not any(r in text for r in REPR)


def _as(form: str, text: str):
    return [{"type": "text", "text": text}] if form == "parts" else text


def _call(arguments) -> dict:
    return {"type": "function", "id": "call_0", "function": {"name": FN, "arguments": arguments}}


def _after(first: str | None, second: str | None, word: str) -> str:
    """What `second` (a conversation with one more message) writes after `first` ends and before the new message's
    word: the template's text between a turn and what follows it."""
    if first is None or second is None or word not in second:
        return ""
    k = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    return second[k:second.index(word, k)] if second.find(word, k) >= 0 else ""


def forms(tokenizer, kwargs: dict) -> Forms:
    """The forms the tokenizer's chat template reads (cached per template and kwargs)."""
    key = (tokenizer.chat_template, json.dumps(kwargs, sort_keys=True, default=str))
    if key not in _cache:
        _cache[key] = _probe(tokenizer, kwargs)
    return _cache[key]


def _probe(tokenizer, kwargs: dict) -> Forms:
    content: dict[str, tuple[str, ...]] = {}
    for form in ("text", "parts"):
        out = _render(tokenizer, [{"role": r, "content": _as(form, WORD[r])} for r in ("user", "assistant")], kwargs)
        for role in ("user", "assistant"):
            if _written(out, WORD[role]):
                content[role] = content.get(role, ()) + (form,)
    user = {"role": "user", "content": _as(content.get("user", ("text",))[0], WORD["user"])}

    def reply(word=WORD["assistant"], **extra):
        return {"role": "assistant", "content": _as(content.get("assistant", ("text",))[0], word), **extra}

    for form in ("text", "parts"):
        if _written(_render(tokenizer, [{"role": "system", "content": _as(form, WORD["system"])}, user, reply()],
                            kwargs), WORD["system"]):
            content["system"] = content.get("system", ()) + (form,)
    arguments = tuple(form for form, args in (("object", {KEY: VALUE}), ("string", json.dumps({KEY: VALUE})))
                      if _written(_render(tokenizer, [user, reply("", tool_calls=[_call(args)])], kwargs), VALUE))
    called = reply("", tool_calls=[_call({KEY: VALUE} if arguments[:1] != ("string",) else json.dumps({KEY: VALUE}))])
    for form in ("text", "parts"):
        result = {"role": "tool", "name": FN, "tool_call_id": "call_0", "content": _as(form, WORD["tool"])}
        if _written(_render(tokenizer, [user, called, result, reply()], kwargs), WORD["tool"]):
            content["tool"] = content.get("tool", ()) + (form,)
    reasoning = next((f for f in REASONING_FIELDS
                      if _written(_render(tokenizer, [user, reply(**{f: REASONING_WORD})], kwargs), REASONING_WORD)),
                     None)
    turn = _render(tokenizer, [user, reply()], kwargs)
    after_turn = _after(turn, _render(tokenizer, [user, reply(), {**user, "content": _as(
        content.get("user", ("text",))[0], NEXT_WORD)}], kwargs), NEXT_WORD)
    result = {"role": "tool", "name": FN, "tool_call_id": "call_0",
              "content": _as(content.get("tool", ("text",))[0], NEXT_WORD)}
    after_call = _after(_render(tokenizer, [user, called], kwargs), _render(tokenizer, [user, called, result], kwargs),
                        NEXT_WORD)
    prompted = _render(tokenizer, [user], kwargs, add_generation_prompt=True)
    plain = _render(tokenizer, [user], kwargs)
    header = prompted[len(plain):] if prompted and plain is not None and prompted.startswith(plain) else ""
    return Forms(content, reasoning, arguments, after_turn, after_call, header)


def _content_in(content, accepted: tuple[str, ...]):
    """The content in a form the template writes: as given when it takes that form, else converted."""
    given = "text" if isinstance(content, str) else "parts"
    if given in accepted or not accepted:
        return content
    if given == "parts":
        return "".join(p["text"] for p in content)
    return [{"type": "text", "text": content}]


def _arguments_in(arguments, accepted: tuple[str, ...]):
    given = "string" if isinstance(arguments, str) else "object"
    if given in accepted or not accepted:
        return arguments
    return json.loads(arguments) if given == "string" else json.dumps(arguments, ensure_ascii=False)


def template_messages(msgs: list[dict], tokenizer, kwargs: dict, at: str) -> list[dict]:
    """A canonical conversation as its template reads it (see the module docstring). An assistant's reasoning that
    the template has no field for is a DataError naming the row: it would be dropped without a word."""
    f = forms(tokenizer, kwargs)
    out = []
    for i, m in enumerate(msgs):
        m = dict(m, content=_content_in(m["content"], f.content.get(m["role"], ())))
        if "reasoning_content" in m:
            if f.reasoning is None:
                raise DataError(
                    f"{at}: assistant message {i} has reasoning (reasoning_content) and the chat template writes "
                    f"none: it reads no field {' / '.join(REASONING_FIELDS)} of an assistant message, so the "
                    "reasoning would be dropped without a word. Fix: set data.chat_template to a template that "
                    "writes reasoning, write the reasoning into the content as the model generates it (if this "
                    "template keeps it there), or remove it from the data")
            m[f.reasoning] = m.pop("reasoning_content")
        if m.get("tool_calls"):
            m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=_arguments_in(
                c["function"]["arguments"], f.arguments))) for c in m["tool_calls"]]
        out.append(m)
    return out
