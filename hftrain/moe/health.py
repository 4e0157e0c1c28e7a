"""Router health: per-layer expert load and router entropy, logged with the training metrics and plotted."""

from __future__ import annotations

import math
import os
import re

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from ..fileio import pyplot, save_figure
from .aux import MaskTap, expert_loads
from .blocks import moe_blocks, routers


class RouterStats:
    """Per-layer top-k selection counts and router entropy, accumulated by forward hooks between two logs (on the
    routers' device: no host sync per forward)."""

    def __init__(self, model):
        self.layers = routers(model)
        # ZeRO-3 partitions weights as the model loads (weight.shape is [0]): ds_shape is the real one
        self.num_experts = [int(getattr(r.weight, "ds_shape", r.weight.shape)[0]) for r in self.layers]
        self.device = self.layers[0].weight.device
        self.tap = MaskTap(model)
        self.reset()
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.layers)]
        self.handles += [b.register_forward_hook(self._dropped_hook) for b in moe_blocks(model)
                         if hasattr(b, "last_dropped")]  # hftrain's expert-parallel / capacity layer

    def reset(self):
        n = len(self.layers)
        self.counts = [torch.zeros(e, dtype=torch.float64, device=self.device) for e in self.num_experts]
        self.sums = torch.zeros(2 * n + 1, dtype=torch.float64, device=self.device)  # entropy, tokens, dropped

    def _hook(self, i):
        n = len(self.layers)

        def hook(module, args, output):
            if not module.training:
                return
            with torch.no_grad():
                logits, indices = output[0], output[2]
                if self.counts[i].device != logits.device:  # moved after construction (Trainer's .to(device))
                    self.device = logits.device
                    self.counts = [c.to(logits.device) for c in self.counts]
                    self.sums = self.sums.to(logits.device)
                mask = self.tap.flat(logits.shape[0])
                w = torch.ones(logits.shape[0], device=logits.device) if mask is None else mask.to(logits.device)
                probs = torch.softmax(logits.float(), dim=-1)
                ent = -(probs * torch.log(probs.clamp(min=1e-20))).sum(-1)
                self.sums[i] += (ent * w).sum().double()
                self.sums[n + i] += w.sum().double()
                self.counts[i] += expert_loads(indices, mask, self.counts[i].numel())
        return hook

    def _dropped_hook(self, module, args, output):
        if module.training:
            self.sums[-1] += float(module.last_dropped)

    def collect(self) -> dict:
        """Stats since the last call, summed over ranks (every rank logs at the same step)."""
        flat = torch.cat([*self.counts, self.sums])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat)
        flat = flat.cpu()
        n, total = len(self.layers), sum(self.num_experts)
        counts, rest = flat[:total].split(self.num_experts), flat[total:]
        ent, tok, dropped = rest[:n], rest[n:2 * n], float(rest[-1])
        out = {}
        for i, c in enumerate(counts):
            if tok[i] <= 0:
                continue
            load = c / c.sum().clamp(min=1)
            for e, v in enumerate(load.tolist()):
                out[f"moe/layer{i}/load_e{e}"] = v
            out[f"moe/layer{i}/entropy"] = float(ent[i] / tok[i]) / math.log(self.num_experts[i])  # 1 = uniform
            out[f"moe/layer{i}/max_load"] = float(load.max()) * self.num_experts[i]  # 1 = balanced
        if out:
            out["moe/dropped_tokens"] = dropped
        self.reset()
        return out


EXPERT_LOAD_FILE = "expert_load.png"


def plot_expert_load(log_history: list[dict], path: str) -> str | None:
    """One panel per MoE layer: each expert's share of the routed tokens against the step. None without data."""
    plt = pyplot()
    pat = re.compile(r"^moe/layer(\d+)/load_e(\d+)$")
    series: dict[int, dict[int, list[tuple[int, float]]]] = {}
    for h in log_history:
        for k, v in h.items():
            m = pat.match(k)
            if m and "step" in h:
                series.setdefault(int(m[1]), {}).setdefault(int(m[2]), []).append((h["step"], v))
    if not series:
        return None
    layers = sorted(series)
    cols = min(4, len(layers))
    rows = -(-len(layers) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False)
    for ax, layer in zip(axes.flat, layers):
        experts = series[layer]
        for e in sorted(experts):
            x, y = zip(*experts[e])
            ax.plot(x, y, marker="o" if len(x) < 20 else None, markersize=2, label=f"e{e}")
        ax.axhline(1 / len(experts), color="grey", lw=0.8, ls="--")
        ax.set_title(f"layer {layer}: expert load")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(experts) <= 8:
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(layers):]:
        ax.axis("off")
    fig.tight_layout()
    return save_figure(fig, path)


class RouterHealthCallback(TrainerCallback):
    """MoE router health: per-layer expert load, normalised router entropy (1 = uniform), max load (1 = balanced),
    dropped tokens; logged each logging step through `pop_logs` (CommHookMixin.log), so they land in trainer_state.json
    (the aux / z losses are logged by the trainer's aux_losses), and `expert_load.png` in output_dir at the end."""

    def __init__(self, model):
        self.stats = RouterStats(model)
        self.layers = self.stats.layers

    def pop_logs(self) -> dict:
        return self.stats.collect()

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            plot_expert_load(state.log_history, os.path.join(args.output_dir, EXPERT_LOAD_FILE))
