"""hftrain's trainers: transformers' `Trainer` (or a TRL trainer) composed with hftrain's concerns, each a mixin that
lives in its feature's package beside the mechanism it drives (trainer/ only composes):

    StagedCheckpointMixin  checkpoints/mixin.py        staged, verified, atomically published checkpoints; resume
    StepGuardMixin         guards/mixin.py             the engine built is the one asked for; finite steps or stop
    CommHookMixin          compression/mixin.py        gradient compression on the data-parallel reduction, comm/*
    StopRequestMixin       stop_request/mixin.py       on SIGUSR1 every rank saves the same step and stops
    SequenceParallelMixin  sequence_parallel/mixin.py  each sequence split across ranks (Ulysses): loader, attention
    ExactLossMixin         losses/exact.py             SFT's CE exact over the global batch, aux terms, eval loss
    ChunkedLossMixin       losses/chunked.py           the per-token CE from logits or, chunked, from lm_head's input
    StreamPositionMixin    data/stream_position.py     a streaming run's position in its checkpoints, resumed exactly
    PartRatesMixin         vision/part_rates.py        an image model's parts at learning rates of their own; said
    TrackersMixin          trackers/mixin.py           the tracker run hftrain owns (MLflow's): one for the whole run

Every option comes from `args` (config.HFTrainingArguments: TrainingArguments + config.HFTrainOptions), so a trainer
is built like transformers' own. The mixins go before the library's trainer in the bases: their overrides run
first and call `super()` through to it. Every method composes RUN_MIXINS onto its trainer (hftrain/methods/: SFT's
onto transformers' Trainer with the loss, sequence-parallel and stream mixins; the others onto TRL's).
"""

from ..checkpoints import StagedCheckpointMixin
from ..losses import ChunkedLossMixin
from ..compression import CommHookMixin
from ..losses import ExactLossMixin
from ..sequence_parallel import SequenceParallelMixin
from ..guards import StepGuardMixin
from ..stop_request import StopRequestMixin
from ..data.stream_position import StreamPositionMixin
from ..vision.part_rates import PartRatesMixin
from ..trackers import TrackersMixin

# What every hftrain trainer has, whatever its loss (the order is the method resolution order).
RUN_MIXINS = (StagedCheckpointMixin, StepGuardMixin, CommHookMixin, StopRequestMixin, PartRatesMixin, TrackersMixin)


__all__ = ["RUN_MIXINS", "StagedCheckpointMixin", "StepGuardMixin", "CommHookMixin", "StopRequestMixin",
           "SequenceParallelMixin", "ExactLossMixin", "ChunkedLossMixin", "StreamPositionMixin",
           "PartRatesMixin", "TrackersMixin"]
