"""Changes to transformers (written against 5.23).

`staged_checkpoint_dir`: for one call of `Trainer._save_checkpoint`, which writes in place under `_get_output_dir()`
and takes no other folder, that folder becomes hftrain's staging folder (hftrain.checkpoints publishes it once
complete). It can go when `_save_checkpoint` writes atomically itself, or takes the folder to write into.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def staged_checkpoint_dir(trainer, root: str):
    """Within the block, `trainer._get_output_dir()` returns `root`."""
    trainer._get_output_dir = lambda trial=None: root
    try:
        yield
    finally:
        del trainer._get_output_dir


def mark_fsdp_managed(model) -> None:
    """Mark an FSDP2 (fully_shard) model as FSDP-managed for transformers' generate() (module docstring)."""
    model._is_fsdp_managed_module = True
