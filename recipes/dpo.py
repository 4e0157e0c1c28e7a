"""Preference tuning from one YAML recipe with a `preference:` section: runs hftrain/recipes/dpo.py (the script lives
in the package, so that `hftrain dpo RECIPE` works after a plain `pip install`; this file keeps the repository's
command working).

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/dpo.py recipes/demo/dpo.yaml [key=value ...]
"""

from hftrain.recipes.dpo import main

if __name__ == "__main__":
    main()
