"""comm/* metrics per optimizer step, for the Trainer's logs (trainer_state.json, TensorBoard)."""

from __future__ import annotations

import time

from transformers import TrainerCallback

from .hooks import HookState


class CommMetricsCallback(TrainerCallback):
    """comm/bytes_raw, comm/bytes_sent, comm/compression_ratio, and under DDP comm/time_share, comm/seconds and
    comm/hidden_share (CommMeter), per optimizer step, averaged over the logging window. CommHookMixin.log merges
    `pop_logs()` into the Trainer's logs (trainer_state.json, TensorBoard).

    DDP: measured by the hook (bytes of the collectives it issued, time any of them was in flight). FSDP and ZeRO:
    the bytes their reduction is configured to send (reduce dtype vs the gradients' dtype); no time share."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.state: HookState | None = None  # set when DDP registers the hook
        self.static: tuple[float, float] | None = None  # (raw, sent) per step for FSDP / ZeRO
        self._t0 = 0.0
        self._steps: list[dict] = []

    def on_hook_registered(self, state: HookState) -> None:
        self.state = state

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.state is None and model is not None and args.world_size > 1 and self.cfg.method in ("fp16", "bf16"):
            params = [p for p in model.parameters() if p.requires_grad]
            n = sum(getattr(p, "ds_numel", p.numel()) for p in params)  # ZeRO-3 partitions hold ds_numel
            size = params[0].element_size() if params else 4
            # Reduce-scatter: (W-1)/W of the bytes, the same factor for both, so the ratio is the dtype ratio.
            w = args.world_size
            self.static = ((w - 1) / w * n * size, (w - 1) / w * n * 2)

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.state is not None:
            self._steps.append(self.state.meter.step_end(self._t0))
        elif self.static is not None:
            self._steps.append({"bytes_raw": self.static[0], "bytes_sent": self.static[1]})

    def pop_logs(self) -> dict:
        steps, self._steps = self._steps, []
        if not steps:
            return {}
        raw = sum(s["bytes_raw"] for s in steps)
        sent = sum(s["bytes_sent"] for s in steps)
        out = {"comm/bytes_raw": raw / len(steps), "comm/bytes_sent": sent / len(steps),
               "comm/compression_ratio": raw / sent if sent else float("nan")}
        for key in ("time_share", "seconds", "hidden_share"):  # DDP only: timed in the hook
            if key in steps[0]:
                out[f"comm/{key}"] = sum(s[key] for s in steps) / len(steps)
        return out
