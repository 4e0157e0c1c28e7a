"""Checkpoints that become visible only when complete, verified before a resume, and resumable on another world size.

The Trainer writes `checkpoint-N` in place and resumes from the highest N whatever is inside, so a save cut short
would be resumed from. hftrain writes into `output_dir/_incomplete/checkpoint-N` and renames it into place once every
rank is done; `_incomplete` matches neither transformers' `checkpoint-*` patterns nor the Hub upload (it skips `_*`).

The package: folders.py (names, completeness, the newest complete one, a failed save's error), manifest.py (sizes
and sha256 of every file, written last), verify.py (what to resume from, checked against its manifest),
world_size.py (how it was written; ZeRO's universal conversion for another world size), mixin.py (the Trainer's
staged save and resume).
"""

from ..errors import CheckpointError
from .folders import (
    PREFIX,
    STAGING,
    STATE,
    WEIGHTS,
    checkpoint_problem,
    newest_complete,
    save_failure,
    staging_root,
)
from .world_size import (
    LATEST_UNIVERSAL,
    LAYOUT,
    UNIVERSAL,
    check_layout,
    checkpoint_format,
    layout,
    layout_problems,
    needs_universal,
    read_layout,
    to_universal,
)
from .mixin import StagedCheckpointMixin
from .verify import resolve_resume, verify, writer

__all__ = ["CheckpointError", "LATEST_UNIVERSAL", "LAYOUT", "PREFIX", "STAGING", "STATE", "UNIVERSAL", "WEIGHTS",
           "StagedCheckpointMixin", "check_layout", "checkpoint_format", "checkpoint_problem", "layout",
           "layout_problems", "needs_universal", "newest_complete", "read_layout", "resolve_resume", "save_failure",
           "staging_root", "to_universal", "verify", "writer"]
