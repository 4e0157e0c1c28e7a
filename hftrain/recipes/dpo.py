"""Preference tuning (DPO, IPO, SimPO, ORPO, KTO) of a causal LM from one YAML recipe with a `preference:` section.

    hftrain dpo recipes/demo/dpo.yaml [key=value ...]
    accelerate launch --config_file accelerate_configs/ddp.yaml -m hftrain.recipes.dpo recipes/demo/dpo.yaml
    python -m hftrain.recipes.dpo recipes/demo/dpo.yaml training.max_steps=10      (one process)

The run's order is hftrain/lifecycle.py's; this holds what preference tuning adds: TRL's config, the policy (the
reference is TRL's: the LoRA adapter disabled, a frozen copy, or precomputed log-probs; ORPO and SimPO have none) and
TRL's trainer for the loss with hftrain's mixins, as the recipe's method says (hftrain/methods/): DPOTrainer for
sigmoid, ipo and simpo (dpo.py), ORPOTrainer for orpo (orpo.py), KTOTrainer for kto (kto.py), judged by held-out
reward accuracy and margin (KTO: margin; its examples are unpaired).
"""

import sys

from hftrain.errors import exit_on_user_error
from hftrain.lifecycle import Method, run
from hftrain.methods import method_of
from hftrain.methods.policy import load_policy, policy_peft_config


class DPO(Method):
    name = "dpo"
    # Those the loss's trainer logs: rewards/accuracies (DPO, ORPO: a pair's chosen reward above its rejected one);
    # ORPO's log odds of the chosen answer over the rejected and its NLL; KTO's KL reference point (its examples are
    # unpaired: no accuracy).
    reported = ("eval_rewards/accuracies", "eval_rewards/margins", "eval_rewards/chosen", "eval_rewards/rejected",
                "eval_log_odds_chosen", "eval_nll_loss", "eval_kl", "eval_loss")

    def arguments(self, recipe, kwargs):
        return method_of(recipe).arguments(recipe, **kwargs)

    def model(self, run):
        return load_policy(run.recipe.model)

    def trainer(self, run, model, tokenizer, data, callbacks):
        trainer_class = method_of(run.recipe).trainer_class  # DPOTrainer's, ORPO's or KTO's, with hftrain's mixins
        return trainer_class(model=model, args=run.args, train_dataset=data.train, eval_dataset=data.eval,
                             processing_class=tokenizer, peft_config=policy_peft_config(run.recipe.model),
                             callbacks=callbacks)


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error():
        run(DPO(), sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
