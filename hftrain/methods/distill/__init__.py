"""Knowledge distillation (hftrain distill RECIPE, a `distill:` section): a student (recipe.model) trained against a
frozen teacher's token distributions (distill.teacher), on the dataset's completions (`logits`) or on completions the
student samples (`on_policy`, GKD's lambda). distill_section.py: the section and its rules; divergence.py: the
divergences in chunks of tokens; trainer.py: the loss, exact over the global batch, and on-policy sampling;
distill.py: the method (its models, its trainer, its held-out metrics)."""
