"""Changes to transformers (written against 5.23).

`staged_checkpoint_dir`: for one call of `Trainer._save_checkpoint`, the folder it writes `checkpoint-N` into (and
rotates old checkpoints in) becomes hftrain's staging folder. `_save_checkpoint` writes in place under
`_get_output_dir()` and takes no argument naming another folder, so a save cut short leaves a `checkpoint-N` that
resume would trust; hftrain publishes the staged folder by rename once complete (hftrain.checkpoints). It can go
when `Trainer._save_checkpoint` writes atomically itself, or takes the folder to write into.
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
