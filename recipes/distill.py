"""Knowledge distillation from one YAML recipe with a `distill:` section: runs hftrain/recipes/distill.py (the script
lives in the package, so that `hftrain distill RECIPE` works after a plain `pip install`; this file keeps the
repository's command working).

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/distill.py RECIPE [key=value ...]
"""

from hftrain.recipes.distill import main

if __name__ == "__main__":
    main()
