"""A canonical example rendered to token ids and labels: the text the template writes, and which of its tokens are
trained. A token is trainable when its characters overlap a trainable span (assistant turns, the completion, or
everything), found through the fast tokenizer's offsets."""

from __future__ import annotations

from ..constants import IGNORE_INDEX
from ..errors import DataError


def render(canon: dict, tokenizer, train_on_prompt: bool) -> tuple[str, list[tuple[int, int]], bool]:
    """(text, trainable char spans, add_special_tokens) for one canonical example."""
    if "messages" in canon:
        msgs = canon["messages"]
        full = tokenizer.apply_chat_template(msgs, tokenize=False)
        if train_on_prompt:
            return full, [(0, len(full))], False
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            start = tokenizer.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True) if i else ""
            end = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=False)
            if not (full.startswith(start) and full.startswith(end)):
                raise DataError(
                    "the chat template is not prefix-stable (rendering the first turns alone differs from the start "
                    "of the whole conversation), so assistant tokens cannot be located; set data.chat_template to a "
                    "template that renders turns independently, or data.assistant_only_loss: false"
                )
            spans.append((len(start), len(end)))
        return full, spans, False
    eos = tokenizer.eos_token or ""
    if "prompt" in canon:
        text = canon["prompt"] + canon["completion"] + eos
        return text, [(0 if train_on_prompt else len(canon["prompt"]), len(text))], True
    text = canon["text"] + eos
    return text, [(0, len(text))], True


def tokenize_example(canon: dict, tokenizer, train_on_prompt: bool) -> dict:
    text, spans, special = render(canon, tokenizer, train_on_prompt)
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


