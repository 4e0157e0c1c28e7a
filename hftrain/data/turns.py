"""Where each assistant turn of a conversation is in the text its chat template writes, and the examples a
conversation becomes.

Every assistant turn is trained as the template writes it when that turn is the conversation's last message (what
the model generates after the generation prompt). Its span runs from the end of the generation prompt (the
conversation before it rendered with add_generation_prompt; or, where the template writes its turns without the
prompt's last piece, e.g. DeepSeek-R1's "<think>\\n", where the two part) through its reasoning, content or tool
calls to its last stop token. What the template writes after that token (a newline) is never generated, and not
trained. A turn the template writes without any of its generation prompt is refused (DeepSeek's templates write a
second tool-calling turn with no header), unless it opens with the template's turn header where the generation
prompt is empty (DiffusionGemma after tool results): the header is then the model's given.

A template that rewrites earlier turns once later messages follow (Qwen3, GLM-4-MoE and gpt-oss drop their
reasoning; gpt-oss ends them with <|end|> instead of <|return|>) does not write such a turn in the whole conversation
as it was generated. Such a turn is trained in an example of its own: the conversation up to and including it.
Every turn the whole conversation writes as generated is trained there, so a prefix-stable template gives one
example per conversation (no extra cost), and a conversation of k assistant turns on Qwen3 gives at most k.

End of turn: a span ends with a token that stops generation (the tokenizer's eos, the eos_token_id of the
generation_config.json beside the tokenizer, and the tokens the template ends a turn with: templates.turn_stop_ids).
A template that ends a turn with nothing and lets the next role's token stop generation (GLM-4-MoE: <|user|>,
<|observation|>; known from its generation config, or from the template alone) gets that token trained: the one
that follows the span, or, after the last message, the one the template writes after such a turn (forms.py).

Nothing is trained that the template does not write: every message's text must be in its rendering (assistant
turns: in their span), or the row is refused naming the message (a template without tool support that drops a tool
call, one that drops reasoning, a message that renders empty)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..errors import DataError
from .forms import REASONING_FIELDS, forms, template_messages
from .offsets import encode
from .templates import apply, turn_stop_ids

EXCERPT = 40  # characters of each side shown where two renderings part
PROBE = "hftrainprobe"  # the words a turn is rendered with to find where it begins (Conversation.start)


@dataclass
class Example:
    """One tokenisable example: its text, the trained character spans, and the assistant messages (by index in the
    conversation) those spans are, in order. `split`: the conversation was cut after its last trained turn, because
    the template writes that turn differently once later messages follow."""

    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    add_special_tokens: bool = False
    split: bool = False


def _probe(content):
    return [{"type": "text", "text": PROBE}] if isinstance(content, list) else PROBE


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def _unstable(at: str, turn: int, part: str, full: str, what: str) -> DataError:
    k = _common(part, full)
    lo = max(0, k - EXCERPT // 2)
    return DataError(
        f"{at}: assistant message {turn} cannot be located: the chat template renders {what} differently from the "
        f"start of the conversation up to and including it (first difference at character {k}: {what} "
        f"{part[lo:k + EXCERPT]!r}, the conversation {full[lo:k + EXCERPT]!r}), so the text before the turn cannot "
        "be told from the turn. Fix: use a template whose generation prompt is how it starts an assistant turn (set "
        "data.chat_template), or set data.assistant_only_loss: false")


class Conversation:
    """A canonical conversation rendered by its template, each prefix at most once."""

    def __init__(self, msgs: list[dict], tools, tokenizer, kwargs: dict, at: str):
        self.canonical, self.tools, self.tokenizer, self.kwargs, self.at = msgs, tools, tokenizer, kwargs, at
        self.msgs = template_messages(msgs, tokenizer, kwargs, at)
        self._texts: dict = {}
        self._starts: dict = {}
        self._prompt_at: dict = {}
        self._closings: dict = {}

    def text(self, n: int, prompt: bool = False) -> str:
        if (n, prompt) not in self._texts:
            self._texts[n, prompt] = apply(self.tokenizer, self.msgs[:n], self.tools, self.kwargs, self.at,
                                           tokenize=False, add_generation_prompt=prompt)
        return self._texts[n, prompt]

    def start(self, i: int) -> int:
        """Where assistant message i's trained span starts in the conversation that ends with it: the end of its
        generation prompt; or where the prompt and the turn part, when the template writes its turns without the
        prompt's last piece (DeepSeek-R1's "<think>\\n"); or, when the template writes the messages before the turn
        differently once the turn follows (gpt-oss drops a tool call's reasoning once a final answer follows), the
        end of the generation prompt's text where the turn begins (found by rendering the turn with other words).
        Where the turn then opens with the template's turn header that this generation prompt does not give
        (DiffusionGemma after tool results: an empty prompt, "<|turn>model\n" written), the header is the prompt:
        the model does not write it."""
        if i not in self._starts:
            prompt, end = self.text(i, prompt=True), self.text(i + 1)
            k = _common(prompt, end)
            if k < len(prompt):
                base = self.text(i)
                if not (end.startswith(base) and k >= len(base)):
                    k = self._rewritten_start(i, prompt[_common(base, prompt):], prompt, end)
                elif k == len(base):
                    k = self._after_header(i, prompt[k:], end, k)
            elif self._opens_with_header(end, k) and self.text(i) == prompt:  # an empty generation prompt
                k = self._after_header(i, "", end, k)
            if len(end) <= k:
                raise DataError(f"{self.at}: assistant message {i} adds no text after the template's generation "
                                "prompt; give it content or tool calls, or remove it")
            self._starts[i] = k
        return self._starts[i]

    def _after_header(self, i: int, gen: str, end: str, k: int) -> int:
        """Where the turn starts when the template writes none of its generation prompt `gen` before it (it follows
        the text before the turn at `k`): after the template's turn header, when the turn opens with it (the
        header is the prompt then); otherwise the row is refused, since the turn is written differently from the
        way the model is prompted for it (DeepSeek's templates write only the first tool-calling turn of a
        conversation with its header)."""
        if self._opens_with_header(end, k):
            return k + len(forms(self.tokenizer, self.kwargs).turn_header)
        raise DataError(
            f"{self.at}: the chat template writes assistant message {i} without its generation prompt: the model is "
            f"prompted with {gen!r} there, the template writes {end[k:k + EXCERPT]!r}, so the turn would be trained "
            "on text the model is never prompted for. Fix: split the row so that each conversation holds such a turn "
            "only where the template writes it after its generation prompt (DeepSeek's templates: one tool-calling "
            "assistant turn per conversation), or set data.chat_template to a template that writes every turn so")

    def _opens_with_header(self, end: str, k: int) -> bool:
        header = forms(self.tokenizer, self.kwargs).turn_header
        return bool(header) and end.startswith(header, k)

    def _rewritten_start(self, i: int, gen: str, prompt: str, end: str) -> int:
        other = dict(self.msgs[i], content=_probe(self.msgs[i]["content"]))
        for name in REASONING_FIELDS:
            if other.get(name):
                other[name] = PROBE
        if other.get("tool_calls"):
            other["tool_calls"] = [dict(c, function=dict(c["function"], name=PROBE)) for c in other["tool_calls"]]
        probe = apply(self.tokenizer, self.msgs[:i] + [other], self.tools, self.kwargs, self.at, tokenize=False)
        at = end.rfind(gen, 0, _common(end, probe)) if gen else -1
        if at < 0:
            raise _unstable(self.at, i, prompt, end, "the conversation before it with the generation prompt")
        self._prompt_at[i] = at
        return at + len(gen)

    def prompt_start(self, i: int) -> int:
        """Where assistant message i's generation prompt begins in the conversation that ends with it."""
        self.start(i)
        if i not in self._prompt_at:
            prompt = self.text(i, prompt=True)
            self._prompt_at[i] = _common(self.text(i), prompt)
        return self._prompt_at[i]

    def closing(self, n: int) -> str:
        """The text the template writes after the last message of the first n messages only when no generation
        prompt follows (Phi-3's eos_token): the rendering from the first token at which it and the prompted one
        part (tokens, not characters: "<|endoftext|>" and "<|assistant|>" share "<|")."""
        if n not in self._closings:
            plain, prompted = self.text(n), self.text(n, prompt=True)
            self._closings[n] = ""
            if not prompted.startswith(plain):
                ids, offsets = encode(self.tokenizer, plain, False)
                other = encode(self.tokenizer, prompted, False)[0]
                k = next((k for k, tok in enumerate(ids) if k >= len(other) or tok != other[k]), len(ids))
                self._closings[n] = plain[offsets[k][0]:] if k < len(ids) else ""
        return self._closings[n]

    def located(self, i: int, text: str) -> tuple[int, int] | None:
        """Assistant message i's span in `text` when `text` writes it as the template does when it is the last
        message (but for the closing text written after a conversation's last message only); else None."""
        start, end = self.start(i), self.text(i + 1)
        if text.startswith(end):
            return start, len(end)
        closing = self.closing(i + 1)
        cut = len(end) - len(closing)
        if closing and closing == self.closing(i) and cut > start and text.startswith(end[:cut]) \
                and text.endswith(closing):
            return start, cut
        return None

    def close(self, text: str, s: int, e: int, i: int) -> tuple[str, int]:
        """(text, span end): the span ends with the turn's last stop token, the one that ends it in generation;
        nothing the template writes after it is trained (module docstring)."""
        stops = stop_texts(self.tokenizer, self.kwargs)
        last = _last_stop(text, s, e, stops)
        if last is not None:
            return text, last
        rest = text[e:].lstrip()
        gap = len(text) - e - len(rest)
        found = next((t for t in stops if rest.startswith(t)), None)
        if found is not None:
            return text, e + gap + len(found)
        if e == len(text):
            f = forms(self.tokenizer, self.kwargs)
            after = f.after_call if self.canonical[i].get("tool_calls") else f.after_turn
            found = next((t for t in stops if after.lstrip().startswith(t)), None)
            if found is not None:
                return text + found, len(text) + len(found)
        return text, e

    def example(self, text: str, located: list[tuple[int, tuple[int, int]]], split: bool) -> Example:
        ex = Example(text, split=split)
        for i, (s, e) in sorted(located, key=lambda x: x[1][0]):
            ex.text, e = self.close(ex.text, s, e, i)
            ex.spans.append((s, e))
            ex.turns.append(i)
        return ex


def stop_texts(tokenizer, kwargs: dict) -> list[str]:
    """The text of each token a trained turn ends with (templates.turn_stop_ids), longest first."""
    key = (id(tokenizer), len(tokenizer), tokenizer.eos_token, getattr(tokenizer, "name_or_path", None),
           tokenizer.chat_template, json.dumps(kwargs, sort_keys=True, default=str))
    if _stops.get(key, (None,))[0] is not tokenizer:
        texts = {tokenizer.decode([i]) for i in turn_stop_ids(tokenizer, kwargs)}
        _stops[key] = (tokenizer, sorted((t for t in texts if t), key=len, reverse=True))
    return _stops[key][1]


_stops: dict = {}


def _last_stop(text: str, s: int, e: int, stops: list[str]) -> int | None:
    """The end of the last stop token in text[s:e], or None when it holds none."""
    ends = [at + len(t) for t in stops if (at := text.rfind(t, s, e)) >= 0]
    return max(ends, default=None)


def conversation_examples(msgs: list[dict], tools, tokenizer, kwargs: dict, at: str,
                          train_turns: str = "all") -> list[Example]:
    """The examples a conversation becomes (module docstring), in the order of their last trained turn;
    train_turns 'last' trains its last assistant turn only."""
    conv = Conversation(msgs, tools, tokenizer, kwargs, at)
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if turns and turns[0] == 0:
        raise DataError(f"{at}: the conversation starts with an assistant message, so the template's text before "
                        "it cannot be told from the turn; start it with a user (or system) message")
    full = conv.text(len(msgs))
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" and (missing := _not_written(m, full)):
            _refuse(m, i, *missing, at, "the conversation's text")
    if not turns:
        return [Example(full)]
    if train_turns == "last":
        turns = turns[-1:]
    examples, left, text, split = [], turns, full, False
    while left:
        here = [(i, span) for i in left if (span := conv.located(i, text)) is not None]
        if here:
            examples.append(conv.example(text, here, split))
            left = [i for i in left if i not in dict(here)]
        if left:
            text, split = conv.text(left[-1] + 1), True
    for ex in examples:
        for i, (s, e) in zip(ex.turns, ex.spans):
            # what the generation prompt holds (Qwen3.5's "<think>\n") is the model's given, not lost
            if _not_written(msgs[i], ex.text[s:e]) and (
                    missing := _not_written(msgs[i], ex.text[min(s, conv.prompt_start(i)):e])):
                _refuse(msgs[i], i, *missing, at, "the text it trains for that turn (and its generation prompt)")
    return sorted(examples, key=lambda ex: ex.turns[-1])


def _variants(value: str) -> tuple[str, ...]:
    """A piece of text as a template may write it: as is, or escaped by tojson."""
    return value, json.dumps(value, ensure_ascii=False)[1:-1], json.dumps(value)[1:-1]


def _leaves(value):
    """The keys and scalar values of a tool call's arguments, as text a template writes them in."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield (str(k),)
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, str):
        yield tuple(line.strip() for line in value.splitlines() if line.strip())[:1] or ()
    elif value is not None:
        yield json.dumps(value), str(value)


def _not_written(m: dict, text: str) -> tuple[str, str] | None:
    """(what, the piece) of a message that is not in `text`: a line of its content or reasoning, its tool calls'
    names and arguments; None when all are."""
    pieces = [("content", line) for part in ([m["content"]] if isinstance(m["content"], str) else
                                             [p.get("text", "") for p in m["content"]])  # an image part: none
             for line in part.splitlines()]
    pieces += [("reasoning", line) for line in m.get("reasoning_content", "").splitlines()]
    for what, line in pieces:
        line = line.strip()
        if line and not any(v in text for v in _variants(line)):
            return what, line
    for call in m.get("tool_calls") or []:
        fn = call["function"]
        args = fn["arguments"]
        for leaf in [(fn["name"],), *_leaves(json.loads(args) if isinstance(args, str) else args)]:
            if leaf and not any(v in text for piece in leaf for v in _variants(piece)):
                return f"tool call {fn['name']!r}", leaf[0]
    return None


def _refuse(m: dict, i: int, what: str, line: str, at: str, where: str) -> None:
    if what == "reasoning":
        fix = "set data.chat_template to a template that writes an assistant turn's reasoning, or remove it"
    elif what.startswith("tool call") or m["role"] == "tool":
        fix = "set data.chat_template to a template with tool support that writes it, or change the row"
    else:
        fix = "set data.chat_template to a template that writes it, or change the row"
    raise DataError(f"{at}: the chat template does not write the {what} of message {i} ({m['role']}): {line[:60]!r} "
                    f"is not in {where}, so the row would be trained without it. Fix: {fix}")
