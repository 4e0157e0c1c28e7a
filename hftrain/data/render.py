"""A canonical example rendered to token ids and labels: the text the template writes, and which of its tokens are
trained. A token is trainable when its characters overlap a trainable span (assistant turns, the completion, or
everything), found through the fast tokenizer's offsets, untrimmed (offsets.py).

A conversation becomes one example, or several when its template rewrites earlier turns (turns.py). Templates with
{% generation %} markers are masked by transformers instead (return_assistant_tokens_mask), with the token that ends
a turn in generation added where the template leaves it outside the marker."""

from __future__ import annotations

from ..constants import IGNORE_INDEX
from .forms import template_messages
from .offsets import encode
from .templates import apply, has_generation_marker, template_kwargs, turn_stop_ids, warn_eos_once, where
from .turns import Example, conversation_examples


def render_examples(canon: dict, tokenizer, train_on_prompt: bool, chat_template_kwargs: dict | None = None,
                    source: str | None = None, train_turns: str = "all") -> list[Example]:
    """The examples (text, trainable char spans) one canonical example becomes."""
    if "messages" in canon:
        at = where(source, canon.get("row"))
        kwargs = template_kwargs(tokenizer, chat_template_kwargs)
        msgs, tools = canon["messages"], canon.get("tools")
        if train_on_prompt:
            full = apply(tokenizer, template_messages(msgs, tokenizer, kwargs, at), tools, kwargs, at, tokenize=False)
            return [Example(full, [(0, len(full))])]
        return conversation_examples(msgs, tools, tokenizer, kwargs, at, train_turns)
    eos = tokenizer.eos_token or ""
    if "prompt" in canon:
        text = canon["prompt"] + canon["completion"] + eos
        return [Example(text, [(0 if train_on_prompt else len(canon["prompt"]), len(text))], add_special_tokens=True)]
    text = canon["text"] + eos
    return [Example(text, [(0, len(text))], add_special_tokens=True)]


def label(example: Example, tokenizer) -> dict:
    """input_ids and labels of one rendered example. A token is trainable when its characters overlap a span.
    Overlap, not "starts inside": a BPE token may merge the template's trailing space with the answer's first letter
    (" c" after "assistant:"), and that token is the answer's first. Zero-width special tokens (an added BOS) never
    are."""
    ids, offsets = encode(tokenizer, example.text, example.add_special_tokens)
    spans = example.spans
    labels = [tok if b > a and any(a < e and b > s for s, e in spans) else IGNORE_INDEX
              for tok, (a, b) in zip(ids, offsets)]
    return {"input_ids": list(ids), "labels": labels}


def _generation_masked(canon: dict, tokenizer, kwargs: dict, at: str) -> dict:
    """ids and labels of a template with {% generation %} markers: transformers' assistant mask, widened by the
    token that ends a turn in generation where the template closes the marker before it."""
    msgs = template_messages(canon["messages"], tokenizer, kwargs, at)
    enc = apply(tokenizer, msgs, canon.get("tools"), kwargs, at, tokenize=True, return_dict=True,
                return_assistant_tokens_mask=True)
    ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    ends = turn_stop_ids(tokenizer, kwargs)
    for k in range(len(ids) - 1):
        if enc["assistant_masks"][k] and not enc["assistant_masks"][k + 1] and ids[k + 1] in ends:
            mask[k + 1] = 1
    return {"input_ids": ids, "labels": [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]}


def tokenize_examples(canon: dict, tokenizer, train_on_prompt: bool, chat_template_kwargs: dict | None = None,
                      source: str | None = None, train_turns: str = "all") -> list[dict]:
    """The per-row function of the dataset build: one canonical row in -> a list of {input_ids, labels} out
    (IGNORE_INDEX where not trained): one example, or one per group of assistant turns when the template rewrites
    earlier turns (turns.py). `source` names where the row comes from in errors ('data.sources.0 (train.jsonl)');
    the row is the example's own 'row' when it has one. `train_turns`: data.train_turns."""
    if "messages" in canon:
        kwargs = template_kwargs(tokenizer, chat_template_kwargs)
        warn_eos_once(tokenizer, kwargs)
        if not train_on_prompt and has_generation_marker(tokenizer):
            return [_generation_masked(canon, tokenizer, kwargs, where(source, canon.get("row")))]
    return [label(ex, tokenizer) for ex in render_examples(canon, tokenizer, train_on_prompt, chat_template_kwargs,
                                                           source, train_turns)]


def tokenize_example(canon: dict, tokenizer, train_on_prompt: bool, chat_template_kwargs: dict | None = None,
                     source: str | None = None, train_turns: str = "all") -> dict:
    """The one example of a row that renders as one (tokenize_examples); a row that becomes several is a
    ValueError (call tokenize_examples)."""
    out = tokenize_examples(canon, tokenizer, train_on_prompt, chat_template_kwargs, source, train_turns)
    if len(out) != 1:
        raise ValueError(f"this row becomes {len(out)} examples (its template rewrites earlier turns); "
                         "call tokenize_examples")
    return out[0]


def trainable_tokens(labels: list[int]) -> int:
    """Tokens that contribute to the loss after the causal shift (what the Trainer counts)."""
    return sum(1 for x in labels[1:] if x != IGNORE_INDEX)
