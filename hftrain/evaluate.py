"""Generation-based evaluation: exact-match accuracy of greedy answers on held-out examples."""

from __future__ import annotations

import torch

from . import distributed


def shard(n: int, rank: int, world: int, lockstep: bool) -> list[tuple[int, bool]]:
    """(example index, counted) for one rank: examples rank, rank + world, ...

    Under `lockstep` every rank must call generate() as often as the others (each forward is a collective), so the
    shorter shards end with a repeat of example 0 whose answer is not counted: each example is counted once."""
    mine = [(i, True) for i in range(rank, n, world)]
    if lockstep and n > 0:
        mine += [(0, False)] * (-(-n // world) - len(mine))
    return mine


@torch.no_grad()
def greedy_answer(model, tokenizer, example: dict, max_new_tokens: int, synced: bool = False) -> str:
    """The model's greedy answer to a held-out example's prompt (chat template with a generation prompt, or the
    plain prompt), decoded without special tokens."""
    if "messages" in example:
        ids = tokenizer.apply_chat_template(example["messages"], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
    else:
        ids = tokenizer(example["prompt"])["input_ids"]
    inp = torch.tensor([ids], device=next(model.parameters()).device)
    out = model.generate(
        input_ids=inp,
        attention_mask=torch.ones_like(inp),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        synced_gpus=synced,
    )
    return tokenizer.decode(out[0, inp.shape[1] :], skip_special_tokens=True)


def exact_match(model, tokenizer, examples: list[dict], max_new_tokens: int = 32, lockstep: bool = False) -> float:
    """Share of `examples` whose greedy answer equals the reference (whitespace-stripped), each example once.

    Each rank generates its shard (`shard`) and the counts are summed over ranks. Sharded models (`lockstep`:
    FSDP, ZeRO-3) generate with `synced_gpus`: a rank whose answer is finished keeps stepping until every rank's is.
    """
    if not examples:
        return float("nan")
    was_training = model.training
    model.eval()
    synced = lockstep and distributed.world_size() > 1
    correct = 0
    for i, counted in shard(len(examples), distributed.rank(), distributed.world_size(), lockstep):
        answer = greedy_answer(model, tokenizer, examples[i], max_new_tokens, synced)
        correct += int(counted and answer.strip() == examples[i]["reference"].strip())
    if was_training:
        model.train()
    return distributed.all_reduce_sum(correct) / len(examples)
