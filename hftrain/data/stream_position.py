"""A streaming run's position in its checkpoints, and resume from it (data.streaming: true; data/stream.py).

SFTTrainer has it first in its bases (it works before any transformers/TRL Trainer subclass). With a training
dataset made by data/stream.py (it carries `.hftrain_stream`) it

- writes `stream_position_<rank>.json` into every checkpoint, from each rank, next to `rng_state_<rank>.pth`
  (transformers' `_save_rng_state` is called by every rank on the folder being written, before hftrain's manifest
  lists the checkpoint's files): the position after the examples the saved step trained on, global_step x
  gradient_accumulation_steps x per_device_train_batch_size of them on each rank (a stream never runs short);
- reads it back where transformers restores the RNG states on resume (`_load_rng_state`, called before the
  epoch's dataloader is iterated), so the stream continues where the uninterrupted run would have;
- sets `args.ignore_data_skip` for such a run: without it transformers would re-read, re-tokenise and throw
  away every example already trained on to find its place.

Without the mixin a streaming run still resumes correctly, by that replay (its time grows with the position).
With any other dataset the mixin does nothing.
"""

from __future__ import annotations

import json
import os

from ..config import DataSection
from ..errors import CheckpointError
from ..fileio import atomic_write
from .stream_identity import stream_change_problem

POSITION_FILE = "stream_position_{rank}.json"


def stream_resume_problems(checkpoint: str, cfg: DataSection) -> list[str]:
    """What `hftrain check` and the run's preflight refuse of resuming `checkpoint` with this data section, before
    the model loads: streaming switched on or off since the checkpoint (the saved position would be ignored without
    a word, or missing after the model loaded), or streamed sources changed since (data.on_stream_change)."""
    path = os.path.join(checkpoint, POSITION_FILE.format(rank=0))
    streamed = os.path.isfile(path)
    if streamed and not cfg.streaming:
        return [f"{checkpoint} was written by a streaming run (it holds {os.path.basename(path)}, the stream's "
                "position) and this recipe does not stream: its position would be ignored and the run would train "
                "from the prepared data's beginning; resume it with data.streaming: true, or start anew"]
    if cfg.streaming and not streamed:
        return [f"{checkpoint} was written by a run that did not stream (no {os.path.basename(path)}) and this recipe "
                "streams: there is no position to continue the stream from; resume it with data.streaming: false, "
                "or start anew"]
    if not streamed:
        return []
    try:
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh).get("sources")
    except (OSError, ValueError, AttributeError) as e:
        return [f"{path} cannot be read ({e}); resume from another checkpoint, or start anew"]
    problem = stream_change_problem(saved, cfg, checkpoint)
    return [problem] if problem else []


class StreamPositionMixin:
    def _hftrain_stream(self):
        return getattr(self.train_dataset, "hftrain_stream", None)

    def train(self, *args, **kwargs):
        if self._hftrain_stream() is not None:
            self.args.ignore_data_skip = True  # the position is restored, not replayed (see the module docstring)
        return super().train(*args, **kwargs)

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        stream = self._hftrain_stream()
        if stream is None:
            return
        a = self.args
        trained = self.state.global_step * a.gradient_accumulation_steps * a.per_device_train_batch_size
        atomic_write(os.path.join(output_dir, POSITION_FILE.format(rank=a.process_index)),
                     json.dumps(stream.state_after(trained)))

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        stream = self._hftrain_stream()
        if stream is None or checkpoint is None:
            return
        name = POSITION_FILE.format(rank=self.args.process_index)
        path = os.path.join(checkpoint, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"cannot resume the stream from {checkpoint}: it has no {name} (it was written by a "
                                  "run that did not stream); resume it with data.streaming: false, or start anew")
        with open(path, encoding="utf-8") as fh:
            stream.resume(json.load(fh))
