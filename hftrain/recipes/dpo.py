"""Preference tuning (DPO, IPO, SimPO, ORPO, KTO) of a causal LM from one YAML recipe with a `preference:` section.

    hftrain dpo recipes/demo/dpo.yaml [key=value ...]
    accelerate launch --config_file accelerate_configs/ddp.yaml -m hftrain.recipes.dpo recipes/demo/dpo.yaml
    python -m hftrain.recipes.dpo recipes/demo/dpo.yaml training.max_steps=10      (one process)

The run's order is hftrain/lifecycle.py's; this holds what preference tuning adds: TRL's config, the policy (the
reference is TRL's: the LoRA adapter disabled, a frozen copy, or precomputed log-probs; ORPO and SimPO have none) and
TRL's trainer for the loss with hftrain's mixins: DPOTrainer for sigmoid, ipo and simpo (hftrain/preference.py),
ORPOTrainer for orpo (hftrain/orpo.py), KTOTrainer for kto (hftrain/kto.py), judged by held-out reward accuracy and
margin (KTO: margin; its examples are unpaired).
"""

import sys

from hftrain.errors import exit_on_user_error
from hftrain.kto import KTOPreferenceTrainer, kto_config
from hftrain.lifecycle import Method, run
from hftrain.orpo import ORPOPreferenceTrainer, orpo_config
from hftrain.preference import PreferenceTrainer, dpo_config, load_policy, policy_peft_config

# preference.loss_type -> (the run's arguments, the trainer); every other loss is DPOTrainer's.
TRAINERS = {"orpo": (orpo_config, ORPOPreferenceTrainer), "kto": (kto_config, KTOPreferenceTrainer)}


class DPO(Method):
    name = "dpo"
    # Those the loss's trainer logs: rewards/accuracies (DPO, ORPO: a pair's chosen reward above its rejected one);
    # ORPO's log odds of the chosen answer over the rejected and its NLL; KTO's KL reference point (its examples are
    # unpaired: no accuracy).
    reported = ("eval_rewards/accuracies", "eval_rewards/margins", "eval_rewards/chosen", "eval_rewards/rejected",
                "eval_log_odds_chosen", "eval_nll_loss", "eval_kl", "eval_loss")

    def arguments(self, recipe, kwargs):
        return TRAINERS.get(recipe.preference.loss_type, (dpo_config,))[0](recipe, **kwargs)

    def model(self, run):
        return load_policy(run.recipe.model)

    def trainer(self, run, model, tokenizer, data, callbacks):
        trainer = TRAINERS.get(run.recipe.preference.loss_type, (None, PreferenceTrainer))[1]
        return trainer(model=model, args=run.args, train_dataset=data.train, eval_dataset=data.eval,
                       processing_class=tokenizer, peft_config=policy_peft_config(run.recipe.model),
                       callbacks=callbacks)


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error():
        run(DPO(), sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
