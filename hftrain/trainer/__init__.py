"""hftrain's trainers: transformers' `Trainer` (or a TRL trainer) with hftrain's concerns mixed in, one module each.

    StagedCheckpointMixin  checkpoints/       staged, verified, atomically published checkpoints; resume
    StepGuardMixin         guards/            the engine built is the one asked for; finite steps or skip / stop
    CommHookMixin          compression/       gradient compression on the data-parallel reduction, comm/* logs
    StopRequestMixin       stop_request/      on SIGUSR1 (a time limit near) every rank saves the same step and stops
    SequenceParallelMixin  sequence_parallel/  each sequence split across ranks (Ulysses): loader, attention, loss
    ExactLossMixin         exact_loss.py      SFT's CE exact over the global batch, aux terms, exact eval loss
    ChunkedLossMixin       chunked_loss.py    the per-token CE from logits or, chunked, from lm_head's input
    StreamPositionMixin    data/stream_position.py  a streaming run's position in its checkpoints, resumed exactly

Every option comes from `args` (config.HFTrainingArguments: TrainingArguments + config.HFTrainOptions), so a trainer
is built like transformers' own. The mixins go before the library's trainer in the bases: their overrides run
first and call `super()` through to it. preference.py, orpo.py, kto.py (and grpo) compose RUN_MIXINS onto TRL's
trainers.
"""

from transformers import Trainer

from ..checkpoints import StagedCheckpointMixin
from .chunked_loss import ChunkedLossMixin
from ..compression import CommHookMixin
from .exact_loss import ExactLossMixin
from ..sequence_parallel import SequenceParallelMixin
from ..guards import StepGuardMixin
from ..stop_request import StopRequestMixin
from ..data.stream_position import StreamPositionMixin

# What every hftrain trainer has, whatever its loss (the order is the method resolution order).
RUN_MIXINS = (StagedCheckpointMixin, StepGuardMixin, CommHookMixin, StopRequestMixin)


class SFTTrainer(StreamPositionMixin, *RUN_MIXINS, SequenceParallelMixin, ExactLossMixin, ChunkedLossMixin, Trainer):
    """Supervised fine-tuning: transformers' Trainer with every hftrain concern."""


__all__ = ["SFTTrainer", "RUN_MIXINS", "StagedCheckpointMixin", "StepGuardMixin", "CommHookMixin", "StopRequestMixin",
           "SequenceParallelMixin", "ExactLossMixin", "ChunkedLossMixin", "StreamPositionMixin"]
