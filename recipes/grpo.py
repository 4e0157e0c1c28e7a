"""GRPO from one YAML recipe with a `grpo:` section: runs hftrain/recipes/grpo.py (the script lives in the package, so
that `hftrain grpo RECIPE` works after a plain `pip install`; this file keeps the repository's command working).

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/grpo.py recipes/demo/grpo.yaml [key=value ...]
"""

from hftrain.recipes.grpo import main

if __name__ == "__main__":
    main()
