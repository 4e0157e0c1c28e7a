"""Held-out answers for image rows (eval.exact_match): each held-out conversation's prompt (its messages but the
last assistant turn) rendered with the generation prompt as training renders a row (the tokenizer's chat template
with data.chat_template_kwargs, one placeholder per image), then through the processor with the row's images (each
placeholder expanded, the pixel values and grids beside the ids); evaluate.greedy_answer answers an example that
carries images with these inputs, and evaluate.exact_match compares the answer with the reference as for text."""

from __future__ import annotations

from ..data.forms import template_messages
from ..data.messages import content_text
from ..data.templates import apply, template_kwargs
from .images import open_rgb

WHERE = "eval.exact_match"


def image_eval_examples(examples: list[dict], n: int) -> list[dict]:
    """The first `n` held-out image examples (labels.py's, which keep their canonical messages) whose conversation
    ends with an assistant turn, as evaluate.exact_match takes them: {messages (the prompt), images, reference}."""
    out = []
    for example in examples:
        msgs = example["messages"]
        if len(out) < n and msgs and msgs[-1]["role"] == "assistant":
            out.append({"messages": msgs[:-1], "images": example["images"],
                        "reference": content_text(msgs[-1]["content"])})
    return out


def image_prompt_inputs(processor, example: dict, chat_template_kwargs: dict | None = None) -> dict:
    """The processor's inputs for a held-out image example's prompt: input_ids (placeholders expanded), pixel values
    and whatever else the family's model reads (Qwen-VL: image grids, token types)."""
    tokenizer = processor.tokenizer
    kwargs = template_kwargs(tokenizer, chat_template_kwargs)
    msgs = template_messages(example["messages"], tokenizer, kwargs, WHERE)
    text = apply(tokenizer, msgs, None, kwargs, WHERE, tokenize=False, add_generation_prompt=True)
    images = [open_rgb(path) for path in example["images"]]
    inputs = dict(processor(text=[text], images=images or None, return_tensors="pt"))
    inputs.pop("attention_mask", None)  # one unpadded row: the generation sets its own
    return inputs

