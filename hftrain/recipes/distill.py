"""Knowledge distillation of a causal LM from one YAML recipe with a `distill:` section: a student (model:) taught by
a frozen teacher (distill.teacher) on the dataset's completions or its own samples (hftrain/methods/distill/).

    hftrain distill RECIPE [key=value ...]
    accelerate launch --config_file accelerate_configs/ddp.yaml -m hftrain.recipes.distill RECIPE
    python -m hftrain.recipes.distill RECIPE training.max_steps=10      (one process)
"""

from hftrain.recipes import entry

main = entry("distill")

if __name__ == "__main__":
    main()
