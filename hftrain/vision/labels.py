"""An image row rendered, tokenised and labelled. The labels are the text families' own (data/render.py: the chat
template's text, assistant turns found by rendering prefixes, characters to tokens by the tokenizer's offsets), on the
text the template writes with one placeholder per image; the input ids are the processor's own output for that text
and the row's images (each placeholder expanded to the processor's per-image token count). The two are aligned token
for token: equal outside the placeholders, each placeholder a run of image tokens in the processor's output, which is
never trained. Anything else the processor changed is a DataError naming the row (its tokenisation would disagree
with the labels)."""

from __future__ import annotations

from ..constants import IGNORE_INDEX
from ..errors import DataError
from ..data.render import label, render_examples
from .images import open_rgb


def expand_labels(plain: dict, expanded: list[int], image_token_id: int, at: str) -> tuple[list[int], list[int]]:
    """(labels of the processor's ids `expanded`, image tokens per placeholder): `plain`'s labels carried over token
    for token, each placeholder's run of image tokens IGNORE_INDEX."""
    ids, labels = plain["input_ids"], plain["labels"]
    out: list[int] = []
    counts: list[int] = []
    j = 0
    for tok, lab in zip(ids, labels):
        if tok == image_token_id:
            run = 0
            while j < len(expanded) and expanded[j] == image_token_id:
                run, j = run + 1, j + 1
            if run == 0:
                break
            counts.append(run)
            out += [IGNORE_INDEX] * run
        elif j < len(expanded) and expanded[j] == tok:
            out.append(lab)
            j += 1
        else:
            break
    if len(out) != len(expanded) or j != len(expanded):
        raise DataError(f"{at}: the processor's tokens differ from the chat template's text beyond expanding the image "
                        f"placeholders (at token {j}); its labels cannot be aligned. The processor and the tokenizer "
                        "must share the chat template and tokenizer")
    return out, counts


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
    image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
    labels, counts = expand_labels(plain, expanded, image_token_id, at)
    if len(counts) != len(images):
        raise DataError(f"{at}: the chat template wrote {len(counts)} image placeholders for the row's {len(images)} "
                        "images")
    return {"input_ids": expanded, "labels": labels, "images": canon["images"]}
