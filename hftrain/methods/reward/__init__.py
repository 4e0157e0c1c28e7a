"""Reward models: a model that scores text, trained from preferences. `reward:` (reward_section.py) selects the kind:
outcome (outcome.py: Bradley-Terry on chosen/rejected pairs, one score per sequence, TRL's RewardTrainer) or process
(a score per reasoning step, on a token-classification head)."""
