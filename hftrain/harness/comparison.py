"""The base model against the trained one, per task and metric: the table `hftrain eval` prints and writes, and the
gate (--min-delta): a metric whose improvement (trained - base, or base - trained where lower is better) falls
below the delta fails the command."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Comparison:
    task: str
    metric: str
    base: float | None
    trained: float
    higher_is_better: bool = True

    @property
    def improvement(self) -> float | None:
        if self.base is None:
            return None
        return self.trained - self.base if self.higher_is_better else self.base - self.trained

    def as_dict(self) -> dict:
        return {**asdict(self), "improvement": self.improvement}

    @classmethod
    def from_dict(cls, d: dict) -> Comparison:
        return cls(d["task"], d["metric"], d.get("base"), d["trained"], d.get("higher_is_better", True))


def _better(higher_is_better: dict, task: str, metric_key: str) -> bool:
    return bool(higher_is_better.get(task, {}).get(metric_key.split(",")[0], True))


def compare(trained: dict, base: dict | None) -> list[Comparison]:
    """One Comparison per task and metric of the trained model's results (harness_results)."""
    out = []
    for task, values in sorted(trained["figures"].items()):
        for key, value in sorted(values.items()):
            if not isinstance(value, (int, float)):
                continue
            before = base["figures"].get(task, {}).get(key) if base else None
            out.append(Comparison(task, key, before, float(value), _better(trained["higher_is_better"], task, key)))
    return out


def _cell(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"


def markdown(comparisons: list[Comparison]) -> str:
    lines = ["| task | metric | base | trained | improvement |", "|---|---|---|---|---|"]
    lines += [f"| {c.task} | {c.metric} | {_cell(c.base)} | {_cell(c.trained)} | {_cell(c.improvement)} |"
              for c in comparisons]
    return "\n".join(lines)


def gate_failures(comparisons: list[Comparison], min_delta: float) -> list[Comparison]:
    """The comparisons whose improvement is below min_delta."""
    return [c for c in comparisons if c.improvement is not None and c.improvement < min_delta]
