"""A canonical example rendered to token ids and labels: the text the template writes, and which of its tokens are
trained. A token is trainable when its characters overlap a trainable span (assistant turns, the completion, or
everything), found through the fast tokenizer's offsets.

An assistant turn's span runs from the end of the generation prompt (the conversation before it rendered with
add_generation_prompt) to the end of the conversation rendered up to and including it: its content or tool calls,
the end-of-turn token (<|im_end|>, <|eot_id|>, <end_of_turn>, </s>, ...) and whatever the template writes after it
(a newline). Both renderings must be the start of the whole conversation's text, or the turn cannot be located and
the row is refused. Templates with {% generation %} markers are masked by transformers instead
(return_assistant_tokens_mask), with the end-of-turn token added where the template leaves it outside the marker."""

from __future__ import annotations

from ..constants import IGNORE_INDEX
from ..errors import DataError
from .templates import apply, end_of_turn, has_generation_marker, template_kwargs, warn_eos_once, where

EXCERPT = 40  # characters of each side shown where two renderings part


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def _unstable(at: str, turn: int, part: str, full: str, what: str) -> DataError:
    k = _first_difference(part, full)
    lo = max(0, k - EXCERPT // 2)
    return DataError(
        f"{at}: assistant message {turn} cannot be located: the chat template renders {what} differently from the "
        f"start of the whole conversation (first difference at character {k}: rendered alone "
        f"{part[lo:k + EXCERPT]!r}, in the whole conversation {full[lo:k + EXCERPT]!r}). The template is not "
        "prefix-stable (it rewrites earlier turns, e.g. drops their reasoning, or its generation prompt is not how "
        "it writes an assistant turn), so the tokens a model generates for this turn are not in the text. Fix: use a "
        "template that writes earlier turns as they were generated, or one with {% generation %} markers (set "
        "data.chat_template), pass data.chat_template_kwargs that make it stable, or set "
        "data.assistant_only_loss: false"
    )


def _closing_starts(tokenizer, plain: str, prompted: str) -> int:
    """Where the text a template writes only after a conversation's last message begins in `plain` (Phi-3's
    eos_token, written unless a generation prompt is asked for): the first token at which the renderings without
    and with the generation prompt part. Such text is trained after the last turn only, where the template
    writes it."""
    a = tokenizer(plain, add_special_tokens=False, return_offsets_mapping=True)
    b = tokenizer(prompted, add_special_tokens=False)["input_ids"]
    for k, (tok, (s, _)) in enumerate(zip(a["input_ids"], a["offset_mapping"])):
        if k >= len(b) or tok != b[k]:
            return s
    return len(plain)


def assistant_spans(msgs: list[dict], tools, tokenizer, kwargs: dict, at: str) -> tuple[str, list[tuple[int, int]]]:
    """(the whole conversation's text, the character span of each assistant turn), by rendering turn by turn."""
    full = apply(tokenizer, msgs, tools, kwargs, at, tokenize=False)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise DataError(f"{at}: the conversation starts with an assistant message, so the template's text before "
                            "it cannot be told from the turn; start it with a user (or system) message")
        start = apply(tokenizer, msgs[:i], tools, kwargs, at, tokenize=False, add_generation_prompt=True)
        if not full.startswith(start):
            raise _unstable(at, i, start, full, "the conversation before it with the generation prompt")
        end = apply(tokenizer, msgs[: i + 1], tools, kwargs, at, tokenize=False)
        if not full.startswith(end):
            prompted = apply(tokenizer, msgs[: i + 1], tools, kwargs, at, tokenize=False, add_generation_prompt=True)
            cut = _closing_starts(tokenizer, end, prompted)
            if not (full.startswith(end[:cut]) and full.endswith(end[cut:]) and cut > len(start)):
                raise _unstable(at, i, end, full, "the conversation up to and including it")
            end = end[:cut]
        if len(end) <= len(start):
            raise DataError(f"{at}: assistant message {i} adds no text after the template's generation prompt; "
                            "give it content or tool calls, or remove it")
        spans.append((len(start), len(end)))
    return full, spans


def render(canon: dict, tokenizer, train_on_prompt: bool, chat_template_kwargs: dict | None = None,
           source: str | None = None) -> tuple[str, list[tuple[int, int]], bool]:
    """(text, trainable char spans, add_special_tokens) for one canonical example."""
    if "messages" in canon:
        at = where(source, canon.get("row"))
        kwargs = template_kwargs(tokenizer, chat_template_kwargs)
        msgs, tools = canon["messages"], canon.get("tools")
        if train_on_prompt:
            full = apply(tokenizer, msgs, tools, kwargs, at, tokenize=False)
            return full, [(0, len(full))], False
        full, spans = assistant_spans(msgs, tools, tokenizer, kwargs, at)
        return full, spans, False
    eos = tokenizer.eos_token or ""
    if "prompt" in canon:
        text = canon["prompt"] + canon["completion"] + eos
        return text, [(0 if train_on_prompt else len(canon["prompt"]), len(text))], True
    text = canon["text"] + eos
    return text, [(0, len(text))], True


def _generation_masked(canon: dict, tokenizer, kwargs: dict, at: str) -> dict:
    """ids and labels of a template with {% generation %} markers: transformers' assistant mask, widened by the
    end-of-turn token where the template closes the marker before it (the token must be trained to stop)."""
    enc = apply(tokenizer, canon["messages"], canon.get("tools"), kwargs, at, tokenize=True, return_dict=True,
                return_assistant_tokens_mask=True)
    ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    eot = end_of_turn(tokenizer, kwargs)
    for k in range(len(ids) - 1):
        if enc["assistant_masks"][k] and not enc["assistant_masks"][k + 1] and ids[k + 1] == eot:
            mask[k + 1] = 1
    return {"input_ids": ids, "labels": [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]}


def tokenize_example(canon: dict, tokenizer, train_on_prompt: bool, chat_template_kwargs: dict | None = None,
                     source: str | None = None) -> dict:
    """input_ids and labels (IGNORE_INDEX where not trained) of one canonical example. `source` names where it
    comes from in errors ('data.sources.0 (train.jsonl)'); the row is the example's own 'row' when it has one."""
    if "messages" in canon:
        kwargs = template_kwargs(tokenizer, chat_template_kwargs)
        warn_eos_once(tokenizer, kwargs)
        if not train_on_prompt and has_generation_marker(tokenizer):
            return _generation_masked(canon, tokenizer, kwargs, where(source, canon.get("row")))
    text, spans, special = render(canon, tokenizer, train_on_prompt, chat_template_kwargs, source)
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
