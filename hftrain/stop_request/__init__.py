"""Stop requests: SIGUSR1 (SLURM's warning before a job's time limit, or `kill -USR1`) recorded by a handler
(signals.py), and acted on by the trainer between optimizer steps at a step every rank agrees on, with a complete
checkpoint (mixin.py)."""

from .mixin import StopRequestMixin
from .signals import arm, clear, requested

__all__ = ["StopRequestMixin", "arm", "clear", "requested"]
