"""GRPO (online RL with verifiable rewards) of a causal LM from one YAML recipe with a `grpo:` section.

    hftrain grpo recipes/demo/grpo.yaml [key=value ...]
    accelerate launch --config_file accelerate_configs/ddp.yaml -m hftrain.recipes.grpo recipes/demo/grpo.yaml
    python -m hftrain.recipes.grpo recipes/demo/grpo.yaml training.max_steps=10      (one process)

The run's order is hftrain/lifecycle.py's; this holds what GRPO adds: TRL's GRPOConfig, the policy (the reference is
TRL's: the LoRA adapter disabled, or a frozen copy), the reward functions and TRL's GRPOTrainer with hftrain's mixins
(hftrain/methods/grpo.py). It is judged as SFT is: exact match of greedy answers to held-out prompts, before and after.
"""

import sys

from hftrain.errors import exit_on_user_error
from hftrain.methods.grpo import GroupTrainer, grpo_config, load_policy, policy_peft_config
from hftrain.lifecycle import run
from hftrain.recipes.sft import SFT
from hftrain.rewards import load_rewards


class GRPO(SFT):  # SFT's held-out exact match (metrics); the rest is GRPO's
    name = "grpo"
    reported = ()  # no held-out loss: the Trainer gets no eval dataset
    trainer_class = GroupTrainer

    def arguments(self, recipe, kwargs):
        return grpo_config(recipe, **kwargs)

    def model(self, run):
        return load_policy(run.recipe.model)

    def trainer(self, run, model, tokenizer, data, callbacks):
        return self.trainer_class(model=model, args=run.args, train_dataset=data.train, processing_class=tokenizer,
                                  reward_funcs=load_rewards(run.recipe.grpo, defer=True),
                                  peft_config=policy_peft_config(run.recipe.model), callbacks=callbacks)


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error():
        run(GRPO(), sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
