"""GRPO (online RL with verifiable rewards) of a causal LM from one YAML recipe with a `grpo:` section
(hftrain/methods/grpo/grpo.py; the reward functions: hftrain/methods/grpo/rewards.py).

    hftrain grpo recipes/demo/grpo.yaml [key=value ...]
    accelerate launch --config_file accelerate_configs/ddp.yaml -m hftrain.recipes.grpo recipes/demo/grpo.yaml
    python -m hftrain.recipes.grpo recipes/demo/grpo.yaml training.max_steps=10      (one process)
"""

from hftrain.recipes import entry

main = entry("grpo")

if __name__ == "__main__":
    main()
