"""Trainer callbacks: observation only (they never change the loss)."""

from __future__ import annotations

import os

from transformers import TrainerCallback

CURVES_FILE = "curves.png"


def plot_curves(log_history: list[dict], path: str) -> str | None:
    """Train/eval loss, learning rate and tokens/s against the step, as one PNG. None when nothing was logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key):
        pts = [(h["step"], h[key]) for h in log_history if key in h and "step" in h]
        return [p[0] for p in pts], [p[1] for p in pts]

    panels = [
        ("loss", [("loss", "train"), ("eval_loss", "eval")]),
        ("learning rate", [("learning_rate", None)]),
        ("tokens/s", [("train_tokens_per_second", None)]),
    ]
    panels = [(t, [(k, lbl) for k, lbl in keys if series(k)[0]]) for t, keys in panels]
    panels = [(t, keys) for t, keys in panels if keys]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
    for ax, (title, keys) in zip(axes[0], panels):
        for key, label in keys:
            x, y = series(key)
            ax.plot(x, y, marker="o" if len(x) < 20 else None, markersize=3, label=label or key)
        ax.set_title(title)
        ax.set_xlabel("step")
        if any(lbl for _, lbl in keys):
            ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
    return path


class CurvesCallback(TrainerCallback):
    """Saves `curves.png` (loss, learning rate, tokens/s) in output_dir at the end of training."""

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            plot_curves(state.log_history, os.path.join(args.output_dir, CURVES_FILE))


EXPERT_LOAD_FILE = "expert_load.png"


def plot_expert_load(log_history: list[dict], path: str) -> str | None:
    """One panel per MoE layer: each expert's share of the routed tokens against the step. None without data."""
    import re

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
    return path


class RouterHealthCallback(TrainerCallback):
    """MoE router health: per-layer expert load, normalised router entropy (1 = uniform), max load (1 = balanced),
    dropped tokens; logged each logging step through `pop_logs` (HFTrainer.log) (so they land in trainer_state.json; the
    aux / z losses are logged by the trainer's aux_losses), and `expert_load.png` in output_dir at the end."""

    def __init__(self, model):
        from .moe import RouterStats

        self.stats = RouterStats(model)
        self.layers = self.stats.layers

    def pop_logs(self) -> dict:
        return self.stats.collect()

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            plot_expert_load(state.log_history, os.path.join(args.output_dir, EXPERT_LOAD_FILE))
