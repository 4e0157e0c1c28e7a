"""Changes to transformers (written against 5.23).

1. `staged_checkpoint_dir`: for one call of `Trainer._save_checkpoint`, which writes in place under
   `_get_output_dir()` and takes no other folder, that folder becomes hftrain's staging folder (hftrain.checkpoints
   publishes it once complete). It can go when `_save_checkpoint` writes atomically itself, or takes the folder to
   write into.
2. `skip_batches_of_sequence_shards`: resuming mid-epoch, the Trainer skips the trained batches with accelerate's
   `skip_first_batches(train_dataloader, k)`, which rebuilds a plain loader from the one it is given: under sequence
   parallelism that is DeepSpeed's Ulysses adapter, which has no dataset, and the resume fails (AttributeError).
   The Trainer's name for that function now hands a loader with its own `skip_first_batches` (hftrain's
   sequence_parallel.ShardedBatches) to it. It can go when the Trainer resumes a sequence-parallel run by itself
   (tests/test_sequence_parallel.py's resume test then passes without it).
3. `mark_fsdp_managed`: generate() keeps every rank stepping until all are done (`synced_gpus`) when
   `is_fsdp_managed_module(model)`, which for FSDP2 reads the attribute transformers' own `apply_fsdp2` sets; a model
   accelerate shards with `fully_shard` lacks it, and GRPO's generation under FSDP2 would hang when one rank finishes
   its completions first. It can go when accelerate's FSDP2 preparation sets that attribute.
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


def skip_batches_of_sequence_shards() -> None:
    """transformers.trainer's `skip_first_batches` defers to a loader's own `skip_first_batches`. Idempotent."""
    import transformers.trainer as trainer_module

    original = trainer_module.skip_first_batches
    if getattr(original, "hftrain_fix", False):
        return

    def skip_first_batches(dataloader, num_batches=0):
        own = getattr(dataloader, "skip_first_batches", None)
        return own(num_batches) if callable(own) else original(dataloader, num_batches)

    skip_first_batches.hftrain_fix = True
    trainer_module.skip_first_batches = skip_first_batches
