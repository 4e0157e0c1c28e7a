"""Preference tuning, one family (selected by the `preference:` section, preference_section.py, whose loss names the
method): dpo.py (DPO and IPO on TRL's DPOTrainer, the exact pair mean), simpo.py (SimPO on it, a constant
reference), orpo.py (TRL's ORPOTrainer), kto.py (TRL's KTOTrainer); their rows: pairs.py (prompt / chosen /
rejected) and unpaired.py (KTO's labelled examples). It never imports the GRPO family (methods/grpo/; the
import-linter contract in pyproject.toml). Nothing is imported here: reading the section loads no trainer."""
