"""on_policy's completions: the student samples one for a row's prompt (the row's tokens before its first completion
token, as data/ rendered and labelled it), and the row becomes prompt + sample, labelled on the sample up to and
including the first token that ends a turn (the tokenizer's eos and the model's generation_config eos ids).

Each row is sampled alone, from a generator seeded by the run's seed, the step and the row's prompt tokens
(`row_seed`), so a row samples the same completion whichever rank and micro-batch it falls in: 2 ranks x GA2 sample
what 1 rank x GA4 samples (the global RNG is left as it was). Alone, because a row's logits in a left-padded batch
differ from its logits alone in the last bits, which can flip a sampled token.

`synced`: the student's forward holds a collective (FSDP2's all-gather of each layer, on_policy.student_for_sampling):
every rank must then run as many forwards as the others. transformers' `synced_gpus` keeps one generate call in
step (a rank whose row has ended runs forwards until every rank's has); `sample_rows` makes every rank run as many
calls (the rows a rank samples may differ in number: lmbda is decided per row), a rank short of rows sampling a
one-token stand-in whose sample is dropped."""

from __future__ import annotations

import hashlib

import torch

from ...constants import IGNORE_INDEX


def real_rows(batch: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row's (token ids, labels) without its padding."""
    return [(ids[mask.bool()], labels[mask.bool()])
            for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"])]


def prompt_of(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A row's tokens before its first labelled token (all its tokens where none is labelled)."""
    first = (labels != IGNORE_INDEX).nonzero()
    return ids[: int(first[0]) if len(first) else len(ids)]


def stop_ids(model, tokenizer) -> set[int]:
    config = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if config is None else [config] if isinstance(config, int) else list(config)
    return {i for i in [tokenizer.eos_token_id, *ids] if i is not None}


def row_seed(seed: int, step: int, tokens: torch.Tensor, purpose: str = "") -> int:
    """A 64-bit seed from the run's seed, the optimizer step and a row's tokens (`purpose` separates the seeds of
    different draws of the same row); a row's sample is seeded by its prompt's."""
    text = f"{seed}:{step}:{purpose}" + ",".join(map(str, tokens.tolist()))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def row_uniform(seed: int, step: int, tokens: torch.Tensor, purpose: str) -> float:
    """A number in [0, 1) that depends on the run's seed, the step and the row's tokens only (`row_seed`)."""
    return row_seed(seed, step, tokens, purpose) / 2**64


def _sample_one(model, prompt: torch.Tensor, seed: int, pad: int, settings: dict, synced: bool):
    """The completion the model samples for one prompt from a generator seeded by `seed` (the RNG state restored)."""
    devices = [prompt.device] if prompt.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        out = model.generate(input_ids=prompt[None], attention_mask=torch.ones_like(prompt)[None], do_sample=True,
                             top_k=0, top_p=1.0, pad_token_id=pad, synced_gpus=synced, **settings)
    return out[0, len(prompt):]


def _cut(completion: torch.Tensor, stops: set[int]) -> torch.Tensor:
    """The completion up to and including its first stop token."""
    for j, token in enumerate(completion.tolist()):
        if token in stops:
            return completion[: j + 1]
    return completion


@torch.no_grad()
def sample_rows(model, tokenizer, prompts: list[torch.Tensor], max_new_tokens: int, temperature: float, seed: int,
                step: int, synced: bool = False, calls: int | None = None) -> list[torch.Tensor]:
    """The completion the model samples for each prompt (plain sampling at `temperature`: no top-k or top-p; each
    prompt seeded by `row_seed`), cut after its first stop token. `synced`, `calls`: the module docstring (`calls`,
    the most prompts any rank samples this step, at least len(prompts))."""
    pad, stops = tokenizer.pad_token_id, stop_ids(model, tokenizer)
    settings = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    out = [_cut(_sample_one(model, p, row_seed(seed, step, p), pad, settings, synced), stops) for p in prompts]
    if synced:
        device = prompts[0].device if prompts else model.device
        stand_in = torch.tensor([pad], device=device)
        for _ in range(len(prompts), calls or len(prompts)):
            _sample_one(model, stand_in, 0, pad, settings, synced)
    return out


def padded(rows: list[tuple[torch.Tensor, torch.Tensor]], pad: int) -> dict:
    """Rows of (token ids, labels) right-padded as the collator pads: input_ids, attention_mask, labels."""
    width = max(len(ids) for ids, _ in rows)
    new_ids = rows[0][0].new_full((len(rows), width), pad)
    labels, attention = torch.full_like(new_ids, IGNORE_INDEX), torch.zeros_like(new_ids)
    for i, (ids, row_labels) in enumerate(rows):
        new_ids[i, :len(ids)], labels[i, :len(ids)], attention[i, :len(ids)] = ids, row_labels, 1
    return {"input_ids": new_ids, "attention_mask": attention, "labels": labels}


def with_completion(prompt: torch.Tensor, completion: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt + completion, labels on the completion only)."""
    labels = torch.cat([torch.full_like(prompt, IGNORE_INDEX), completion])
    return torch.cat([prompt, completion]), labels
