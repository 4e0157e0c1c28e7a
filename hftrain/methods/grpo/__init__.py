"""GRPO, one family (selected by the `grpo:` section, grpo_section.py): grpo.py (TRL's GRPOTrainer with hftrain's
mixins), prompts.py (its prompts' data phase), rewards.py (the reward functions), tools.py (tools in rollouts),
environments.py (an environment per rollout), and the guard all user code runs under (user_code.py: time limit, copies
of the inputs, exits caught; watchdog.py: the process that ends a call stuck in C code). It never imports the
preference family (methods/preference/; the import-linter contract in pyproject.toml). Nothing is imported here:
reading the section loads no trainer."""
