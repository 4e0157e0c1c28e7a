"""GRPO runs for tests/test_grpo_runs.py: variants of one recipe trained one after another in one launch (1 rank x
GA4, or 2 ranks x GA2 under a strategy), each saved to OUT_ROOT/VARIANT, with completions that do not depend on the
layout.

    [accelerate launch --config_file accelerate_configs/S.yaml] tests/grpo_worker.py RECIPE OUT_ROOT VARIANT ...

Why a test double for the sampling: TRL seeds every rank differently and samples a batch at once, so 1 and 2 ranks
draw different completions. Here each completion is generated alone (TRL's own generation, under the strategy's
engine), seeded by the step and its place in the global generation batch, which are the same in every layout. The
rest is the real run: rewards gathered over ranks, group advantages, the loss and its normalisation, the update.

The `tools` variant (issue 41) rolls out over several turns with TRL's tool loop: every other completion of the
generation batch (by its place in it) is a call of the `add` tool below, the tool answers, and the model goes on
from the tool's answer, seeded by that context, which is the same in every layout. Its loss is normalised over the
tokens the model generated (dapo: the global count, the tools' answers masked out).
"""

import dataclasses
import os
import sys
import time
import zlib

import torch
import trl

from hftrain import distributed
from hftrain.artifacts import save_final
from hftrain.methods import load_recipe
from hftrain.constants import ZERO_STAGE
from hftrain.data.templates import stop_at_end_of_turn
from hftrain.errors import exit_on_user_error
from hftrain.lifecycle import read_data
from hftrain.methods.grpo.grpo import METHOD, GroupTrainer
from hftrain.launch import Run, setup_run
from hftrain.launch.setup import run_arguments

QWEN2_5 = os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen2_5.jinja")
VARIANTS = {
    # per-sequence mean, KL to a frozen copy, two updates per generation batch (the clipping bites on the second)
    "grpo": ["grpo.loss_type=grpo", "grpo.beta=0.2", "grpo.num_iterations=2", "grpo.epsilon=0.05"],
    # the reference is the policy with its LoRA adapter disabled
    "dr_grpo": ["grpo.loss_type=dr_grpo", "grpo.beta=0.2", "model.lora.r=4", "model.lora.alpha=8",
                "model.lora.dropout=0.0"],
    "dapo": ["grpo.loss_type=dapo"],
    # TRL's bnpo: each micro-batch's own token mean (a mean of means), not offered by hftrain; set on the arguments
    "bnpo": ["grpo.loss_type=dapo"],
    # multi-turn rollouts: TRL's tool loop with the Qwen2.5 template (one TRL parses tool calls from)
    "tools": ["grpo.loss_type=dapo", "grpo.tools=[tests/grpo_worker.py:add]", "grpo.max_completion_length=64",
              "data.max_length=1024", f"data.chat_template={QWEN2_5}"],
    # the same calls answered by an environment (Adder), whose get_reward is a reward beside grpo.rewards; the call
    # at place 0 of each step hangs it: that rollout ends with reward 0 after grpo.tool_timeout, the run goes on
    "environment": ["grpo.loss_type=dapo", "grpo.environment=tests/grpo_worker.py:Adder", "grpo.tool_timeout=1",
                    "grpo.max_completion_length=64", "data.max_length=1024", f"data.chat_template={QWEN2_5}"],
}
TOOL_CALL = '<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": 1}}}}\n</tool_call>'


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return str(a + b)


class Adder:
    """An environment whose tool is `add`; rewarded when its last sum was odd."""

    def __init__(self):
        self.total = None

    def reset(self, **row):
        self.total = None

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        if a == 0:
            time.sleep(120)  # stuck: the guard's timeout ends the rollout
        self.total = a + b
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total is not None and self.total % 4 == 1)


class SeededTrainer(GroupTrainer):
    _after_a_tool = False

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self._after_a_tool:  # seeded by the context (the prompt, the call, the tool's answer)
            seeds = [f"{self.state.global_step}/{ids}" for ids in prompt_ids]
        else:
            first = self.accelerator.process_index * len(prompt_ids)  # this rank's slice of the generation batch
            seeds = [f"{self.state.global_step}/{first + i}" for i in range(len(prompt_ids))]
        completions = []
        for seed, ids in zip(seeds, prompt_ids):
            place = int(seed.split("/")[1]) if not self._after_a_tool else None
            if self.tools and place is not None and place % 2 == 0:
                call = self._tokenizer.encode(TOOL_CALL.format(a=place), add_special_tokens=False)
                completions.append(call + [self._tokenizer.convert_tokens_to_ids("<|im_end|>")])
                continue
            torch.manual_seed(zlib.crc32(seed.encode()))
            completions += super()._generate_single_turn([ids], images, multimodal_fields, num_generations)[0]
        return completions, None

    def _tool_call_loop(self, *args, **kwargs):
        self._after_a_tool = True
        try:
            return super()._tool_call_loop(*args, **kwargs)
        finally:
            self._after_a_tool = False


def main(recipe_path: str, out_root: str, names: list[str], trainer_class: type = SeededTrainer,
         variants: dict | None = None) -> None:
    """Each variant of `variants` (default: VARIANTS) named in `names`, trained by `trainer_class` and saved."""
    variants = VARIANTS if variants is None else variants
    method = dataclasses.replace(METHOD, trainer_class=trainer_class)
    run = setup_run([recipe_path, f"training.output_dir={out_root}/{names[0]}", *variants[names[0]]], "grpo")
    extra = {"deepspeed": run.args.deepspeed} if run.strategy.name in ZERO_STAGE else {}
    for name in names:
        recipe = load_recipe(recipe_path, [f"training.output_dir={out_root}/{name}", *variants[name]])
        args = method.arguments(recipe, **run_arguments(recipe, run.strategy, None, **extra))
        if name == "bnpo":
            args.loss_type = "bnpo"
        this = Run(recipe, run.strategy, args)
        tokenizer, data = read_data(this)
        model = method.model(this)
        stop_at_end_of_turn(model, tokenizer, recipe.data.chat_template_kwargs)
        trainer = method.trainer(this, model, tokenizer, data, [])
        trainer.train()
        save_final(trainer, recipe, run.strategy, tokenizer, {})
        del trainer, model
    distributed.shutdown()


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1], sys.argv[2], sys.argv[3:])
