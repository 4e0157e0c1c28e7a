"""on_policy's step: which rows train on the student's samples (GKD's lambda), and the student made ready to sample
under each strategy.

lambda is decided per ROW, not per micro-batch: a row trains on the student's sample when a number in [0, 1) drawn
from the run's seed, the step and the row's tokens (sampling.row_uniform) is below distill.lmbda, else on its dataset
completion. TRL 1.16's GKDTrainer.training_step draws `random.random() <= lmbda` once per micro-batch on each rank's
own RNG: which rows are sampled then depends on how the step's rows are cut into micro-batches and ranks (2 ranks x
GA2 hold other rows together than 1 rank x GA4), and the ranks' draws may disagree (under ZeRO-3 one rank would gather
the student for generation while another does not). Per row, the same rows are sampled whatever the world size and
accumulation, so the step's tokens, and the loss over them, are the same; the expected share of sampled rows is
lambda as in GKD. Rows of one micro-batch may then mix sampled and dataset completions (each labelled on its own).

The student for sampling (`student_for_sampling`), entered by every rank once per step:
- ZeRO-3: TRL's unwrap_model_for_generation (as its GKDTrainer and GRPOTrainer): the partitioned parameters gathered
  whole for the step's sampling, DeepSpeed's hooks removed, so no forward holds a collective (`synced` False);
- FSDP2: left sharded: each forward all-gathers the layers it runs (TRL's GRPOTrainer generates so too), so every
  rank runs as many forwards (`synced` True: sampling.sample_rows);
- DDP: the module itself (`synced` False)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from trl.models import unwrap_model_for_generation

from .sampling import padded, prompt_of, real_rows, row_uniform, sample_rows, with_completion


@contextmanager
def student_for_sampling(trainer):
    """(the student to call generate on, whether its forwards hold a collective), in eval mode for the block."""
    if trainer.is_deepspeed_enabled:
        context, synced = unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator), False
    else:
        context, synced = _unwrapped(trainer), trainer.is_fsdp_enabled and trainer.accelerator.num_processes > 1
    with context as model:
        was_training = model.training
        model.eval()
        try:
            yield model, synced
        finally:
            model.train(was_training)


@contextmanager
def _unwrapped(trainer):
    yield trainer.accelerator.unwrap_model(trainer.model)


def picked(rows: list[tuple[torch.Tensor, torch.Tensor]], lmbda: float, seed: int, step: int) -> list[bool]:
    """Which rows train on the student's sample this step (the module docstring)."""
    return [row_uniform(seed, step, ids, "lmbda") < lmbda for ids, _ in rows]


def most_calls(trainer, count: int) -> int:
    """The most rows any rank samples this step (every rank calls this)."""
    if trainer.accelerator.num_processes == 1:
        return count
    return int(trainer.accelerator.gather(torch.tensor([count], device=trainer.args.device)).max())


def on_policy_step(trainer, batch_samples: list[dict], lmbda: float, max_new_tokens: int, temperature: float
                   ) -> list[dict]:
    """The step's micro-batches with the rows lambda picks made prompt + the student's sample; the others, and
    micro-batches with no row picked, as they were."""
    seed, step, pad = trainer.args.seed, trainer.state.global_step, trainer.processing_class.pad_token_id
    rows = [real_rows(batch) for batch in batch_samples]
    chosen = [picked(batch_rows, lmbda, seed, step) for batch_rows in rows]
    prompts = [prompt_of(*row) for batch_rows, picks in zip(rows, chosen) for row, pick in zip(batch_rows, picks)
               if pick]
    with student_for_sampling(trainer) as (model, synced):
        calls = most_calls(trainer, len(prompts)) if synced else len(prompts)
        samples = iter(sample_rows(model, trainer.processing_class, prompts, max_new_tokens, temperature, seed, step,
                                   synced, calls))
    out = []
    for batch, batch_rows, picks in zip(batch_samples, rows, chosen):
        if not any(picks):
            out.append(batch)
            continue
        mixed = [with_completion(prompt_of(*row), next(samples)) if pick else row
                 for row, pick in zip(batch_rows, picks)]
        out.append(padded(mixed, pad))
    return out
