"""Supervised fine-tuning from one YAML recipe: runs hftrain/recipes/sft.py (the script lives in the package, so that
`hftrain sft RECIPE` works after a plain `pip install`; this file keeps the repository's command working).

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/sft.py recipes/demo/sft.yaml [key=value ...]
"""

from hftrain.recipes.sft import main

if __name__ == "__main__":
    main()
