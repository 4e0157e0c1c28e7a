"""From a recipe to running processes: strategies (config rendering), preflight (the one validation path), set-up
(environment, patches and process group, in one call) and the memory plan.

The names below load on first use (PEP 562): `python -m hftrain.launch.launcher`, the process between `hftrain
launch` and the workers, needs only accelerate's launch command, and importing preflight and set-up eagerly made it
import transformers, peft and the rest (about 7 s of CPU per launch)."""

from __future__ import annotations

import importlib

_HOMES = {"check_data": "data_checks", "check_recipe": "preflight", "Run": "setup", "claim_output_dir": "setup",
          "setup_run": "setup", "write_strategy_configs": "setup"}

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value
