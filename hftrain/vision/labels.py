"""An image row rendered, tokenised and labelled. The labels are the text families' own (data/render.py: the chat
template's text, assistant turns found by rendering prefixes, characters to tokens by the tokenizer's offsets), on the
text the template writes with one placeholder per image; the input ids are the processor's own output for that text
and the row's images (each placeholder expanded: Qwen-VL and LLaVA into a run of image tokens, Gemma 3 into its
image's start and end tokens around them, with blank lines). The two are aligned token for token: equal outside the
expansions, each expansion untrained, and what the expansion replaced of the template's tokens (the placeholder, and
where the tokenizer merges them with the expansion's, neighbouring blanks) untrained too. Anything else the processor
changed is a DataError naming the row (its tokenisation would disagree with the labels)."""

from __future__ import annotations

from difflib import SequenceMatcher

from ..constants import IGNORE_INDEX
from ..errors import DataError
from ..data.render import label, render_examples
from .families import image_token_ids
from .images import open_rgb


def _not_aligned(at: str, where: int, why: str) -> DataError:
    return DataError(f"{at}: the processor's tokens differ from the chat template's text beyond expanding the image "
                     f"placeholders (at token {where}: {why}); its labels cannot be aligned. The processor and the "
                     "tokenizer must share the chat template and tokenizer")


def expand_labels(plain: dict, expanded: list[int], placeholder_id: int, image_token_id: int,
                  at: str) -> tuple[list[int], list[tuple[int, int, int, int]]]:
    """(labels of the processor's ids `expanded`, the expansions: (start, end, first image, images) each, a stretch
    of `expanded` that images placed side by side share): `plain`'s labels carried over token for token where the
    two agree, every token of a placeholder's expansion IGNORE_INDEX. The placeholders are made
    unique before the two are matched (difflib, no junk heuristic), so each lies in a changed stretch of its own or
    shared with its neighbours; a changed stretch without a placeholder, one whose expansion holds no image token, or
    one that replaces a trained token of the template is refused."""
    ids, labels = plain["input_ids"], plain["labels"]
    marked = [-1 - k if t == placeholder_id else t for k, t in enumerate(ids)]
    out: list[int] = []
    spans: list[tuple[int, int, int, int]] = []
    for op, i1, i2, j1, j2 in SequenceMatcher(None, marked, expanded, autojunk=False).get_opcodes():
        if op == "equal":
            out += labels[i1:i2]
            continue
        placeholders = sum(t < 0 for t in marked[i1:i2])
        image_tokens = sum(t == image_token_id for t in expanded[j1:j2])
        if placeholders == 0 or image_tokens == 0:
            raise _not_aligned(at, j1, "a change without an image" if placeholders == 0 else "an image without tokens")
        if any(lab != IGNORE_INDEX for t, lab in zip(marked[i1:i2], labels[i1:i2]) if t >= 0):
            raise _not_aligned(at, j1, "a trained token of the template replaced")
        spans.append((j1, j2, sum(n for *_, n in spans), placeholders))
        out += [IGNORE_INDEX] * (j2 - j1)
    return out, spans


def image_tokens_in(example: dict, image_token_id: int) -> list[tuple[list[int], int]]:
    """Per expansion of the example (labels.expand_labels' spans): (the indices of its images, its image tokens)."""
    ids = example["input_ids"]
    return [(list(range(first, first + count)), sum(t == image_token_id for t in ids[start:end]))
            for start, end, first, count in example["image_spans"]]


def image_example(canon: dict, processor, train_on_prompt: bool, chat_template_kwargs: dict | None, at: str,
                  train_turns: str = "all") -> dict:
    """{input_ids, labels, images} of one canonical image row (image_rows.py): the processor's ids, the template's
    labels (every assistant turn, or the last: data.train_turns), image tokens never trained."""
    tokenizer = processor.tokenizer
    examples = render_examples({"messages": canon["messages"]}, tokenizer, train_on_prompt, chat_template_kwargs, at,
                               train_turns)
    if len(examples) != 1:
        raise DataError(f"{at}: the chat template writes earlier turns differently once later ones follow, so the "
                        "row would become several examples; image rows of such templates are not supported yet")
    example = examples[0]
    plain = label(example, tokenizer)
    images = [open_rgb(p) for p in canon["images"]]
    enc = processor(text=[example.text], images=images or None)
    expanded = list(enc["input_ids"][0])
    labels, spans = expand_labels(plain, expanded, *image_token_ids(processor), at)
    placeholders = sum(n for *_, n in spans)
    if placeholders != len(images):
        raise DataError(f"{at}: the chat template wrote {placeholders} image placeholders for the row's {len(images)} "
                        "images")
    return {"input_ids": expanded, "labels": labels, "images": canon["images"], "image_spans": spans}
