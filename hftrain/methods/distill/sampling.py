"""on_policy's completions: the student samples one for each row's prompt (the row's tokens before its first
completion token, as data/ rendered and labelled it), and the row becomes prompt + sample, labelled on the sample up
to and including the first token that ends a turn (the tokenizer's eos and the model's generation_config eos ids)."""

from __future__ import annotations

import torch

from ...constants import IGNORE_INDEX


def prompts_of(batch: dict) -> list[torch.Tensor]:
    """Each row's tokens before its first labelled token (all its tokens where none is labelled)."""
    out = []
    for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
        real = mask.bool()
        ids, labels = ids[real], labels[real]
        first = (labels != IGNORE_INDEX).nonzero()
        out.append(ids[: int(first[0]) if len(first) else len(ids)])
    return out


def stop_ids(model, tokenizer) -> set[int]:
    config = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if config is None else [config] if isinstance(config, int) else list(config)
    return {i for i in [tokenizer.eos_token_id, *ids] if i is not None}


def _left_padded(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = prompts[0].new_full((len(prompts), width), pad)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask


def _cut(completion: torch.Tensor, stops: set[int]) -> torch.Tensor:
    """The completion up to and including its first stop token."""
    for j, token in enumerate(completion.tolist()):
        if token in stops:
            return completion[: j + 1]
    return completion


@torch.no_grad()
def sample_completions(model, tokenizer, batch: dict, max_new_tokens: int, temperature: float) -> dict:
    """The batch with each row's completion replaced by one the model samples (plain sampling at `temperature`: no
    top-k or top-p), right-padded as the collator pads: input_ids, attention_mask, labels."""
    prompts = prompts_of(batch)
    pad = tokenizer.pad_token_id
    ids, mask = _left_padded(prompts, pad)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0,
                         top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=pad)
    stops = stop_ids(model, tokenizer)
    completions = [_cut(row, stops) for row in out[:, ids.shape[1]:]]
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    new_ids = ids.new_full((len(prompts), width), pad)
    labels, attention = torch.full_like(new_ids, IGNORE_INDEX), torch.zeros_like(new_ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        n = len(p) + len(c)
        new_ids[i, :n] = torch.cat([p, c])
        labels[i, len(p):n] = c
        attention[i, :n] = 1
    return {"input_ids": new_ids, "attention_mask": attention, "labels": labels}
