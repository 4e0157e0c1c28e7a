"""The policy of the methods built on TRL's trainers (DPO and its relatives, ORPO, KTO, GRPO): the model to tune, and
the LoRA config TRL wraps it with."""

from __future__ import annotations

import dataclasses

from ..config import ModelSection
from ..modeling import load_model, lora_config


def load_policy(cfg: ModelSection):
    """The model to tune; with model.lora the base model, for TRL to wrap with `policy_peft_config`: TRL computes the
    reference with that fresh adapter disabled (no copy). A model wrapped beforehand would make TRL copy the adapter
    as a 'ref' adapter, for adapters trained earlier."""
    return load_model(cfg if cfg.lora is None else dataclasses.replace(cfg, lora=None))


def policy_peft_config(cfg: ModelSection):
    """The LoraConfig TRL wraps the policy with (model.lora), or None."""
    return lora_config(cfg) if cfg.lora is not None else None
