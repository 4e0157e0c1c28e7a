"""What every exact loss over the optimizer step's global batch asks of its trainer, written once: the step's counts
(tokens, sequences, pairs, examples) summed over every micro-batch and rank, and a micro-batch's share of the loss
(maths.normalise: its sum over the global count, times the ranks the engine averages gradients over). SFT's loss
(exact.py) and the preference methods (methods/preference/: dpo.py, orpo.py, kto.py) use it."""

from __future__ import annotations

import torch

from . import maths


class GlobalBatchMixin:
    # compute_loss returns the micro-batch's share of the global loss: the Trainer must not divide it again.
    loss_is_scaled_for_ga = True

    def global_sum(self, local: torch.Tensor) -> torch.Tensor:
        """`local` (a count or a vector of them, this rank's micro-batches summed) summed over the data-parallel ranks
        (a gather over all; the tensor-parallel ranks of a group hold the same micro-batches, each counted once)."""
        if self.args.world_size == 1:
            return local
        total = self.accelerator.gather(local.reshape(1, *local.shape)).sum(0)
        tensor_parallel = self.get_tp_size()
        if tensor_parallel == 1:
            return total
        return total // tensor_parallel if not total.is_floating_point() else total / tensor_parallel

    def data_parallel_size(self) -> int:
        """The ranks the engine averages gradients over: every rank but tensor-parallel copies. With sequence
        parallelism too: each rank's loss sum is its slice's share, ZeRO averages over all ranks
        (patches.deepspeed.average_gradients_over_sequence_ranks), and the slices' gradients add up."""
        return self.accelerator.num_processes // self.get_tp_size()

    def step_share(self, loss_sum: torch.Tensor, global_count: torch.Tensor | int) -> torch.Tensor:
        """A micro-batch's share of the step's exact loss (maths.normalise)."""
        return maths.normalise(loss_sum, global_count, self.data_parallel_size())
