"""Supervised fine-tuning of a causal LM from one YAML recipe (what SFT adds to the run: hftrain/methods/sft.py).

    hftrain sft recipes/demo/sft.yaml [key=value ...]
    accelerate launch --config_file accelerate_configs/ddp.yaml -m hftrain.recipes.sft recipes/demo/sft.yaml
    python -m hftrain.recipes.sft recipes/demo/sft.yaml training.max_steps=10      (one process)
"""

from hftrain.recipes import entry

main = entry("sft")

if __name__ == "__main__":
    main()
