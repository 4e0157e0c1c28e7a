"""Generation-based evaluation: exact-match accuracy of greedy answers on held-out examples."""

from __future__ import annotations

import torch

from . import distributed


@torch.no_grad()
def exact_match(model, tokenizer, examples: list[dict], max_new_tokens: int = 32) -> float:
    """Share of `examples` whose greedy answer equals the reference (whitespace-stripped).

    Each rank generates its slice (rank::world); counts are summed over ranks. `model` is the unwrapped model.
    """
    if not examples:
        return float("nan")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct = 0
    mine = examples[distributed.rank() :: distributed.world_size()]
    for ex in mine:
        if "messages" in ex:
            ids = tokenizer.apply_chat_template(ex["messages"], add_generation_prompt=True, return_dict=True)["input_ids"]
        else:
            ids = tokenizer(ex["prompt"])["input_ids"]
        inp = torch.tensor([ids], device=device)
        out = model.generate(
            input_ids=inp,
            attention_mask=torch.ones_like(inp),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        answer = tokenizer.decode(out[0, inp.shape[1] :], skip_special_tokens=True)
        correct += int(answer.strip() == ex["reference"].strip())
    if was_training:
        model.train()
    return distributed.all_reduce_sum(correct) / len(examples)
