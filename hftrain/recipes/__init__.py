"""The training methods as scripts: each defines what differs from the shared run (hftrain/lifecycle.py) and runs it.

    hftrain sft RECIPE [key=value ...]        (or: accelerate launch ... -m hftrain.recipes.sft RECIPE ...)
    hftrain dpo RECIPE [key=value ...]        (or: accelerate launch ... -m hftrain.recipes.dpo RECIPE ...)

`recipes/sft.py` and `recipes/dpo.py` in the repository run these same modules.
"""
