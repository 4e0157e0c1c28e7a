"""Text cut before tokenisation, and the check that the cut did not change what trains.

Why the text is cut first: tokenising a 5 MB cell to keep its first 64 tokens costs ~1.4 GB (the fast tokenizer's
offsets of every character). No token is longer than the longest string in the vocabulary (`char_bound`), so the
first `(max_length + MARGIN) x longest` characters of a field give at least max_length + MARGIN tokens of it; the
tokens kept are those of the uncut text (BPE merges are local: the cut only changes tokens near it, beyond
max_length). A string (a message's content or its text parts, its reasoning, a prompt, a completion, a text) is cut
only when it is longer than the bound.

A chat template need not write a field as given: DeepSeek-R1's and Qwen3's drop the reasoning an earlier assistant
turn carries inline in its content (the text before its "</think>"), so cutting that content before its "</think>"
would make the template write the reasoning and push every later turn out of the example. Hence `cut_changes`:
for a conversation that was cut, every rendering the examples are made from (each prefix of the conversation, with
and without the generation prompt) is rendered from the uncut conversation too (text only, no tokenising), and the
two must agree on all of it, or on a prefix that holds max_length + MARGIN / 2 tokens (or `limit` characters, that
many surely). Where they do not, the row is tokenised uncut (rare: only rows with a field over the bound, on a
template that rewrites it)."""

from __future__ import annotations

from ..errors import DataError
from .forms import template_messages
from .offsets import encode
from .templates import apply, template_kwargs

MARGIN = 64  # tokens past max_length that a cut text still has


def char_bound(tokenizer, max_length: int) -> int:
    """Characters of a text field that surely hold more than max_length tokens (see the module docstring)."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return (max_length + MARGIN) * max(longest, 1)


def _cut(v, limit: int):
    return v[:limit] if isinstance(v, str) and len(v) > limit else v


def _long(v, limit: int) -> bool:
    return isinstance(v, str) and len(v) > limit


def _message(m: dict, limit: int) -> dict:
    content = m.get("content")
    if isinstance(content, list):
        content = [dict(p, text=_cut(p["text"], limit)) if _long(p.get("text"), limit) else p for p in content]
    else:
        content = _cut(content, limit)
    out = {**m, "content": content}
    if "reasoning_content" in m:
        out["reasoning_content"] = _cut(m["reasoning_content"], limit)
    return out


def _too_long(m: dict, limit: int) -> bool:
    content = m.get("content")
    parts = content if isinstance(content, list) else [{"text": content}]
    return _long(m.get("reasoning_content"), limit) or any(_long(p.get("text"), limit) for p in parts)


def bounded(canon: dict, limit: int) -> dict:
    """The canonical example with every text longer than `limit` characters cut to `limit`; the example itself when
    none is."""
    if "messages" in canon:
        if not any(_too_long(m, limit) for m in canon["messages"]):
            return canon
        return {**canon, "messages": [_message(m, limit) for m in canon["messages"]]}
    if not any(_long(v, limit) for v in canon.values()):
        return canon
    return {k: _cut(v, limit) for k, v in canon.items()}


def _common(a: str, b: str) -> int:
    """The length of the common prefix of two long texts (bisected: slices compare at C speed)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _render(tokenizer, msgs: list[dict], tools, kwargs: dict, prompt: bool) -> str | None:
    try:
        return apply(tokenizer, msgs, tools, kwargs, "", tokenize=False, add_generation_prompt=prompt)
    except DataError:
        return None


def cut_changes(canon: dict, cut: dict, tokenizer, chat_template_kwargs: dict | None, max_length: int,
                limit: int) -> bool:
    """Whether tokenising the cut conversation (`bounded(canon, limit)`) might not give the uncut one's first
    max_length tokens and labels (module docstring). Prompt/completion and text rows are written as given: their
    cut never changes them."""
    if cut is canon or "messages" not in canon:
        return False
    try:
        kwargs = template_kwargs(tokenizer, chat_template_kwargs)
        whole = template_messages(canon["messages"], tokenizer, kwargs, "")
        short = template_messages(cut["messages"], tokenizer, kwargs, "")
    except DataError:
        return True  # the uncut tokenisation names the row's problem
    roles = [m["role"] for m in whole]
    for n in range(1, len(whole) + 1):
        near = "assistant" in roles[n - 1:n + 1]  # the renderings turns.py makes with the generation prompt
        for prompt in (False, True) if near else (False,):
            a = _render(tokenizer, short[:n], cut.get("tools"), kwargs, prompt)
            b = _render(tokenizer, whole[:n], canon.get("tools"), kwargs, prompt)
            if a == b:
                continue
            if a is None or b is None:
                return True
            k = _common(a, b)
            if k < limit and len(encode(tokenizer, a[:k], False)[0]) < max_length + MARGIN // 2:
                return True
    return False
