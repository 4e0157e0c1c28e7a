"""Preference tuning (DPO, IPO, SimPO) of a causal LM from one YAML recipe with a `preference:` section.

    hftrain dpo recipes/demo/dpo.yaml [key=value ...]
    accelerate launch --config_file accelerate_configs/ddp.yaml -m hftrain.recipes.dpo recipes/demo/dpo.yaml
    python -m hftrain.recipes.dpo recipes/demo/dpo.yaml training.max_steps=10      (one process)

The run's order is hftrain/lifecycle.py's; this holds what preference tuning adds: TRL's DPOConfig, the policy (the
reference is TRL's: the LoRA adapter disabled, a frozen copy, or precomputed log-probs) and TRL's DPOTrainer with
hftrain's mixins (hftrain/preference.py), judged by held-out reward accuracy and margin.
"""

import sys

from hftrain.errors import exit_on_user_error
from hftrain.lifecycle import Method, run
from hftrain.preference import PreferenceTrainer, dpo_config, load_policy, policy_peft_config


class DPO(Method):
    name = "dpo"
    reported = ("eval_rewards/accuracies", "eval_rewards/margins", "eval_rewards/chosen", "eval_rewards/rejected",
                "eval_loss")

    def arguments(self, recipe, kwargs):
        return dpo_config(recipe, **kwargs)

    def model(self, run):
        return load_policy(run.recipe.model)

    def trainer(self, run, model, tokenizer, data, callbacks):
        return PreferenceTrainer(model=model, args=run.args, train_dataset=data.train, eval_dataset=data.eval,
                                 processing_class=tokenizer, peft_config=policy_peft_config(run.recipe.model),
                                 callbacks=callbacks)


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error():
        run(DPO(), sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
