"""on_policy's completions: the student samples one for each row's prompt (the row's tokens before its first
completion token, as data/ rendered and labelled it), and the row becomes prompt + sample, labelled on the sample up
to and including the first token that ends a turn (the tokenizer's eos and the model's generation_config eos ids).

Each row is sampled alone, from a generator seeded by the run's seed, the step and the row's prompt tokens
(`row_seed`), so a row samples the same completion whichever rank and micro-batch it falls in: 2 ranks x GA2 sample
what 1 rank x GA4 samples (the global RNG is left as it was). Alone, because a row's logits in a left-padded batch
differ from its logits alone in the last bits, which can flip a sampled token."""

from __future__ import annotations

import hashlib

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


def row_seed(seed: int, step: int, prompt: torch.Tensor) -> int:
    """The seed of one row's sample: the run's seed, the optimizer step and the prompt's tokens."""
    text = f"{seed}:{step}:" + ",".join(map(str, prompt.tolist()))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _sample_one(model, prompt: torch.Tensor, seed: int, pad: int, max_new_tokens: int, temperature: float):
    """The completion the model samples for one prompt from a generator seeded by `seed` (the RNG state restored)."""
    devices = [prompt.device] if prompt.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        out = model.generate(input_ids=prompt[None], attention_mask=torch.ones_like(prompt)[None], do_sample=True,
                             temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                             pad_token_id=pad)
    return out[0, len(prompt):]


def _cut(completion: torch.Tensor, stops: set[int]) -> torch.Tensor:
    """The completion up to and including its first stop token."""
    for j, token in enumerate(completion.tolist()):
        if token in stops:
            return completion[: j + 1]
    return completion


@torch.no_grad()
def sample_completions(model, tokenizer, batch: dict, max_new_tokens: int, temperature: float, seed: int,
                       step: int) -> dict:
    """The batch with each row's completion replaced by one the model samples (plain sampling at `temperature`: no
    top-k or top-p; each row seeded by `row_seed`), right-padded as the collator pads: input_ids, attention_mask,
    labels."""
    prompts = prompts_of(batch)
    pad = tokenizer.pad_token_id
    stops = stop_ids(model, tokenizer)
    completions = [_cut(_sample_one(model, p, row_seed(seed, step, p), pad, max_new_tokens, temperature), stops)
                   for p in prompts]
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    new_ids = prompts[0].new_full((len(prompts), width), pad)
    labels, attention = torch.full_like(new_ids, IGNORE_INDEX), torch.zeros_like(new_ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        n = len(p) + len(c)
        new_ids[i, :n] = torch.cat([p, c])
        labels[i, len(p):n] = c
        attention[i, :n] = 1
    return {"input_ids": new_ids, "attention_mask": attention, "labels": labels}
