"""Generation-based evaluation: exact-match accuracy of greedy answers on held-out examples."""

from __future__ import annotations

import torch

from . import distributed
from .data.templates import template_kwargs


def prompt_ids(tokenizer, example: dict, chat_template_kwargs: dict | None = None) -> list[int]:
    """The ids a held-out example's answer is generated after: its messages with the generation prompt, rendered
    with the same data.chat_template_kwargs (and pinned date) as training; or its plain prompt."""
    if "messages" in example:
        kwargs = template_kwargs(tokenizer, chat_template_kwargs)
        return tokenizer.apply_chat_template(example["messages"], add_generation_prompt=True, return_dict=True,
                                             **kwargs)["input_ids"]
    return tokenizer(example["prompt"])["input_ids"]


@torch.no_grad()
def exact_match(model, tokenizer, examples: list[dict], max_new_tokens: int = 32, lockstep: bool = False,
                chat_template_kwargs: dict | None = None) -> float:
    """Share of `examples` whose greedy answer equals the reference (whitespace-stripped).

    Replicated models: each rank generates its slice (rank::world) and counts are summed over ranks.
    Sharded models (`lockstep`: FSDP, ZeRO-3): every forward is a collective, so every rank generates every
    example (greedy decoding makes the ranks agree on each answer's length) with `synced_gpus`.
    """
    if not examples:
        return float("nan")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct = 0
    mine = examples if lockstep else examples[distributed.rank() :: distributed.world_size()]
    for ex in mine:
        inp = torch.tensor([prompt_ids(tokenizer, ex, chat_template_kwargs)], device=device)
        out = model.generate(
            input_ids=inp,
            attention_mask=torch.ones_like(inp),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            synced_gpus=lockstep and distributed.world_size() > 1,
        )
        answer = tokenizer.decode(out[0, inp.shape[1] :], skip_special_tokens=True)
        correct += int(answer.strip() == ex["reference"].strip())
    if was_training:
        model.train()
    return (correct if lockstep else distributed.all_reduce_sum(correct)) / len(examples)
