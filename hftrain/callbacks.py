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
