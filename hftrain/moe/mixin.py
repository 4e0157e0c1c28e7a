"""MoE in the Trainer, the one way it enters one: `MoeMixin.__init__(..., moe=recipe.moe)` wires the `moe:` section
(moe.attach: ZeRO-3 leaf modules, aux / z losses, expert parallelism, router health, bias balancing) when the trainer
is built, not by editing it afterwards. Expert parallelism (expert_parallel.py: the layer): each rank holds other
experts, so what the Trainer does over "the" parameters is done here over every rank's:

- the gradient norm, for clipping and for the logged grad_norm: the dense gradients (equal on every rank after DDP's
  average) and every rank's experts (expert_parallel.clip_grad_norm_);
- the saved model: every save gathers all experts first (save_model), whatever asked for it;
- the optimizer state: the Trainer saves rank 0's optimizer.pt, which holds rank 0's experts; each rank also saves
  the state of its own experts (EXPERT_OPTIMIZER) and puts it back after the Trainer's load on resume.
Without experts split over ranks every method is the Trainer's own.
"""

from __future__ import annotations

import os

import torch

from ..errors import CheckpointError
from . import attach
from . import expert_parallel as ep
from .blocks import unwrap

EXPERT_OPTIMIZER = "expert_optimizer_rank{rank}.pt"  # one per rank: the optimizer state of its own experts


class MoeMixin:
    _split_experts: tuple[dict, object] | None = None

    def __init__(self, *args, moe=None, **kwargs):
        """`moe`: the recipe's moe: section (None: a dense model, or an MoE model trained as it is)."""
        super().__init__(*args, **kwargs)
        attach(self, moe)

    def _experts(self) -> tuple[dict, object]:
        """(this rank's expert parameters by name, their group), found once, at the first use in train(): the blocks
        are swapped before it (moe.attach) and stay (FSDP2 replaces the dense parameters, not these)."""
        if self._split_experts is None:
            model = unwrap(self.model)
            blocks = ep.parallel_blocks(model)
            self._split_experts = (ep.local_experts(model), blocks[0].group if blocks else None)
        return self._split_experts

    def _global_norm(self, max_norm: float):
        experts, group = self._experts()
        return ep.clip_grad_norm_(unwrap(self.model), max_norm, list(experts.values()), group)

    def _clip_grad_norm(self, model):
        if not self._experts()[0]:
            return super()._clip_grad_norm(model)
        return self._global_norm(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and self._experts()[0]:
            grad_norm = self._global_norm(float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every save (a checkpoint, the final save, one a callback or a stop request asks for) writes all experts in
        the native layout: every rank gathers them first (a collective; the Trainer calls save_model on every rank).
        The gathered copies stay for what reads the saved model next (the optimizer's save, the run's digest) and are
        dropped when training goes on (expert_parallel.ExpertParallelCallback)."""
        if self._experts()[0]:
            ep.gather_for_save(unwrap(self.model))
        super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        experts = self._experts()[0]
        if experts:  # every rank, into the staged checkpoint (the Trainer's main process may not have made it yet)
            state = {name: self.optimizer.state[p] for name, p in experts.items() if p in self.optimizer.state}
            os.makedirs(output_dir, exist_ok=True)
            torch.save(state, os.path.join(output_dir, EXPERT_OPTIMIZER.format(rank=self.args.process_index)))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        experts = self._experts()[0]
        if checkpoint is None or not experts:
            return
        path = os.path.join(checkpoint, EXPERT_OPTIMIZER.format(rank=self.args.process_index))
        if not os.path.isfile(path):
            raise CheckpointError(f"cannot resume from {checkpoint}: {os.path.basename(path)} (this rank's experts' "
                                  "optimizer state) is missing; resume with the checkpoint's moe.expert_parallel_size "
                                  "and processes, or with training.resume_weights_only: true")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        for name, p in experts.items():
            state = self.optimizer.state[p]
            for key, value in saved.get(name, {}).items():
                if key in state and isinstance(state[key], torch.Tensor):
                    state[key].copy_(value)  # onto the tensors the Trainer's load made: their device and dtype
                else:
                    state[key] = value.to(p.device) if isinstance(value, torch.Tensor) else value
