"""Gradient compression (this package) on the data-parallel reduction the Trainer's accelerator builds:
DDP gets hftrain's comm hook, FSDP2 its reduce dtype (ZeRO's is in the DeepSpeed config); comm/* metrics logged.

Why here: the Trainer builds its own DistributedDataParallelKwargs (accelerate's `comm_hook` argument never reaches
it), so the hook goes into the handler right after the accelerator is created."""

from __future__ import annotations

from torch.distributed.fsdp import MixedPrecisionPolicy

from ..config import CompressionSection
from . import hooks as comp
from .metrics import CommMetricsCallback


class CommHookMixin:
    comm_metrics: CommMetricsCallback | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.comm_metrics is not None:
            self.add_callback(self.comm_metrics)

    @property
    def compression(self) -> CompressionSection | None:
        """args.compression as a section when it does anything: a method, or method none with profile (the plain
        all-reduce timed in hftrain's hook; DDP only, rules.py)."""
        cfg = self.args.compression
        if not cfg:
            return None
        section = CompressionSection(**cfg)
        return section if section.method != "none" or section.profile else None

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        cfg = self.compression
        if cfg is None:
            return
        self.comm_metrics = CommMetricsCallback(cfg)
        if self.accelerator.ddp_handler is not None:
            self.accelerator.ddp_handler = comp.ddp_kwargs_with_hook(
                self.accelerator.ddp_handler, cfg, self.comm_metrics.on_hook_registered)
        reduce_dtype = comp.fsdp_reduce_dtype(cfg)
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if plugin is not None and reduce_dtype is not None:
            old = plugin.mixed_precision_policy
            plugin.mixed_precision_policy = MixedPrecisionPolicy(
                param_dtype=getattr(old, "param_dtype", None), reduce_dtype=reduce_dtype,
                output_dtype=getattr(old, "output_dtype", None))

    def log(self, logs: dict, start_time=None) -> None:
        """A training log gets the metrics of every callback with a `pop_logs()` (comm/* of compression, moe/* of
        router health): called on every rank, since one may run a collective."""
        if "loss" in logs:
            for cb in self.callback_handler.callbacks:
                if hasattr(cb, "pop_logs"):
                    logs.update(cb.pop_logs())
        super().log(logs, start_time)
