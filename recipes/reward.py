"""Reward modelling from one YAML recipe with a `reward:` section: runs hftrain/recipes/reward.py (the script lives
in the package, so that `hftrain reward RECIPE` works after a plain `pip install`; this file keeps the repository's
command working).

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/reward.py RECIPE [key=value ...]
"""

from hftrain.recipes.reward import main

if __name__ == "__main__":
    main()
