"""Reward modelling from one YAML recipe with a `reward:` section: kind outcome trains a sequence classifier on
chosen/rejected pairs (hftrain/methods/reward/outcome.py; the section: methods/reward/reward_section.py).

    hftrain reward recipes/demo/reward.yaml [key=value ...]
    accelerate launch --config_file accelerate_configs/ddp.yaml -m hftrain.recipes.reward RECIPE
    python -m hftrain.recipes.reward RECIPE training.max_steps=10      (one process)
"""

from hftrain.recipes import entry

main = entry("reward")

if __name__ == "__main__":
    main()
