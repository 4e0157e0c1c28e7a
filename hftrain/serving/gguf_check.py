"""A GGUF file loaded back through transformers' own GGUF loader (`gguf_file=`, weights dequantised) and compared with
the model it was written from: the largest logit difference over the prompts and how many greedy answers are the
same (the source's tokenizer and generation settings for both: the weights alone are compared), and how many prompts
the tokenizer the file carries (with its chat template) turns into the source's ids."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..evaluate import greedy_answer, prompt_ids
from ..heads import Head


@dataclass(frozen=True)
class GgufCheck:
    gguf_type: str
    path: str
    size_bytes: int
    max_logit_difference: float
    same_answers: int
    same_prompt_ids: int
    prompts: int


def _load(folder: str, gguf_file: str | None = None):
    """A language model (what llama.cpp serves), from its folder or a GGUF file in it."""
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return Head.CAUSAL_LM.auto_class.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()


@torch.no_grad()
def check_gguf(source: str, gguf_path: str, gguf_type: str, examples: list[dict], max_new_tokens: int) -> GgufCheck:
    """`examples`: held-out rows ({"messages": [...]}) whose prompts both models answer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    folder, name = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    carried = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    trained, written = _load(source), _load(folder, name)
    written.generation_config = trained.generation_config  # where each stops: the source's end-of-turn ids
    largest, same, same_ids = 0.0, 0, 0
    for example in examples:
        ids = torch.tensor([prompt_ids(tokenizer, example)])
        same_ids += carried.chat_template is not None and prompt_ids(carried, example) == ids[0].tolist()
        largest = max(largest, (written(ids).logits - trained(ids).logits).abs().max().item())
        same += greedy_answer(written, tokenizer, example, max_new_tokens) == greedy_answer(
            trained, tokenizer, example, max_new_tokens)
    return GgufCheck(gguf_type, gguf_path, os.path.getsize(gguf_path), largest, same, same_ids, len(examples))
