"""The training methods as scripts: each defines what differs from the shared run (hftrain/lifecycle.py) and runs it.

    hftrain sft RECIPE [key=value ...]        (or: accelerate launch ... -m hftrain.recipes.sft RECIPE ...)
    hftrain dpo RECIPE [key=value ...]        (or: accelerate launch ... -m hftrain.recipes.dpo RECIPE ...)
    hftrain grpo RECIPE [key=value ...]       (or: accelerate launch ... -m hftrain.recipes.grpo RECIPE ...)

`recipes/sft.py`, `recipes/dpo.py` and `recipes/grpo.py` in the repository run these same modules.
"""
