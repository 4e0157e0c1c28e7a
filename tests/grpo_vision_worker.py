"""GRPO runs on prompts with images for tests/test_vision_grpo.py, as tests/grpo_worker.py runs text ones: variants of
one recipe trained in one launch (1 rank x GA4, or 2 ranks x GA2 under a strategy), each completion generated alone
with TRL's own generation, seeded by the step and its place in the global generation batch (the same in every
layout), its prompt's image fields sliced from the batch's (one image per prompt here), and ended with EOS after a
number of tokens set by its place (a random tiny model seldom samples EOS): completions of different lengths, so that
a mean of micro-batch token means (TRL's bnpo, the control) differs from the global one.

    [accelerate launch --config_file accelerate_configs/S.yaml] tests/grpo_vision_worker.py RECIPE OUT_ROOT VARIANT ...

The reward is a function of the completion's tokens alone (`token_spread`), so that rewards and advantages differ
within every group of a random tiny model's samples, as the exactness runs need.
"""

import sys
import zlib

import torch

from hftrain.errors import exit_on_user_error
from hftrain.methods.grpo.grpo import GroupTrainer
from tests import grpo_worker

VARIANTS = {
    # per-sequence mean, KL to a frozen copy, two updates per generation batch (the clipping bites on the second)
    "grpo": ["grpo.loss_type=grpo", "grpo.beta=0.2", "grpo.num_iterations=2", "grpo.epsilon=0.05"],
    "dapo": ["grpo.loss_type=dapo"],
    "bnpo": ["grpo.loss_type=dapo"],  # set to TRL's bnpo on the arguments (grpo_worker.main): the control
}


def token_spread(prompts, completions, completion_ids, **_):
    """A reward of the completion's tokens alone, spread over [0, 1] (the sum of its ids modulo 7, over 6)."""
    return [(sum(ids) % 7) / 6 for ids in completion_ids]


def one_prompts_fields(fields: dict, i: int, n: int) -> dict:
    """Prompt i's image fields of a batch of `n` prompts with one image each (arrays or tensors, as the processor
    returns them): Qwen-VL's patches (its image grid's product of rows each), LLaVA's one pixel array, a per-prompt
    field's row."""
    grid = fields.get("image_grid_thw")
    rows = [int(r) for r in (grid.prod(-1) if grid is not None else [])]
    out = {}
    for key, value in fields.items():
        if key == "pixel_values" and rows:
            out[key] = value[sum(rows[:i]):sum(rows[:i + 1])]
        elif len(value) == n:
            out[key] = value[i:i + 1]
        else:
            raise AssertionError(f"an image field the test cannot slice: {key} of {len(value)} for {n} prompts")
    return out


class SeededVisionTrainer(GroupTrainer):
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        first = self.accelerator.process_index * len(prompt_ids)  # this rank's slice of the generation batch
        completions = []
        for i, ids in enumerate(prompt_ids):
            assert images is not None and len(images[i]) == 1, "one image per prompt"
            torch.manual_seed(zlib.crc32(f"{self.state.global_step}/{first + i}".encode()))
            fields = one_prompts_fields(multimodal_fields, i, len(prompt_ids))
            (sampled,) = super()._generate_single_turn([ids], [images[i]], fields, num_generations)[0]
            ended = list(sampled)[:1 + (first + i) % 5] + [self._tokenizer.eos_token_id]  # lengths 2 to 6, EOS last
            completions.append(ended if len(ended) < len(sampled) else list(sampled))
        return completions, None


if __name__ == "__main__":
    with exit_on_user_error():
        grpo_worker.main(sys.argv[1], sys.argv[2], sys.argv[3:], SeededVisionTrainer, VARIANTS)
