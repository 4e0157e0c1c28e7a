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


@dataclass(frozen=True)
class TrainedReference:
    """The model the files were written from, loaded once for every type: its tokenizer, the held-out rows the files
    are checked on and its greedy answers to them (one per row)."""
    tokenizer: object
    model: object
    examples: list[dict]
    answers: list[str]


@torch.no_grad()
def trained_reference(source: str, examples: list[dict], max_new_tokens: int) -> TrainedReference:
    """`examples`: held-out rows ({"messages": [...]}) whose prompts both models answer."""
    from transformers import AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(source), _load(source)
    return TrainedReference(tokenizer, model, examples,
                            [greedy_answer(model, tokenizer, e, max_new_tokens) for e in examples])


@torch.no_grad()
def check_gguf(reference: TrainedReference, gguf_path: str, gguf_type: str, max_new_tokens: int) -> GgufCheck:
    """One file against the reference, on the reference's held-out rows."""
    from transformers import AutoTokenizer

    tokenizer, trained = reference.tokenizer, reference.model
    folder, name = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    carried = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    written = _load(folder, name)
    written.generation_config = trained.generation_config  # where each stops: the source's end-of-turn ids
    largest, same, same_ids = 0.0, 0, 0
    for example, answer in zip(reference.examples, reference.answers):
        ids = torch.tensor([prompt_ids(tokenizer, example)])
        same_ids += carried.chat_template is not None and prompt_ids(carried, example) == ids[0].tolist()
        largest = max(largest, (written(ids).logits - trained(ids).logits).abs().max().item())
        same += greedy_answer(written, tokenizer, example, max_new_tokens) == answer
    return GgufCheck(gguf_type, gguf_path, os.path.getsize(gguf_path), largest, same, same_ids, len(reference.examples))
