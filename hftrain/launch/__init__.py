"""From a recipe to running processes: strategies (config rendering), preflight (the one validation path), set-up
(environment, patches and process group, in one call) and the memory plan."""

from .preflight import check_data, check_recipe
from .setup import Run, claim_output_dir, setup_run, write_strategy_configs

__all__ = ["check_data", "check_recipe", "Run", "claim_output_dir", "setup_run", "write_strategy_configs"]
