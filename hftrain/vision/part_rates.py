"""Per-part learning rates of an image-text-to-text model (`model.part_learning_rates`: vision_tower, projector,
language_model, as model.freeze names the parts), and what the optimizer trains, said at the start of every run of an
image model. ms-swift's vit_lr / aligner_lr, LLaMA-Factory's freeze flags: a tower tuned at a tenth of the language
model's rate, or a projector alone at a higher one.

transformers' Trainer builds one optimizer over two parameter groups (weight decay or not) at training.learning_rate;
PartRatesMixin rebuilds it (the same class and settings) with each of those groups split by part, a part's group at
its rate, before the schedule is made (so the schedule scales every group, warm-up and decay alike). Under DDP, FSDP2
and ZeRO-3 (the strategies image models run under) the optimizer transformers builds is the one that steps, so its
groups are the ones that count."""

from __future__ import annotations

import sys

from ..distributed import print0
from .families import CHECKED, section_family
from .freezing import part_names, part_of_parameters, unwrapped


def part_rate_problems(section) -> list[tuple[str, str]]:
    """(key, problem) for model.part_learning_rates of a model section (checked before anything loads)."""
    rates = getattr(section, "part_learning_rates", None) or {}
    if not rates:
        return []
    family, refused = section_family(section, "model.part_learning_rates",
                                     "sets the learning rates of an image-text-to-text model's parts")
    if refused:
        return refused
    parts, frozen = part_names(family), getattr(section, "freeze", None) or []
    out = []
    for name, rate in rates.items():
        key = f"model.part_learning_rates.{name}"
        if name not in parts:
            out.append((key, f"{name!r} is not a part of a {family} model; its parts: {', '.join(parts)}"))
        elif isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0:
            out.append((key, f"must be a positive learning rate, not {rate!r}"))
        elif name in frozen:
            out.append((key, f"{name} is in model.freeze: a frozen part has no learning rate; remove one of them"))
    return out


def _split_by_part(groups: list[dict], part_of: dict[int, str], rates: dict[str, float]) -> list[dict]:
    """Each group split by the parts of its parameters, a part with a rate of its own at that rate."""
    out = []
    for group in groups:
        for part in sorted({part_of[id(p)] for p in group["params"]}):
            params = [p for p in group["params"] if part_of[id(p)] == part]
            rate = {"lr": rates[part]} if part in rates else {}
            out.append({**{k: v for k, v in group.items() if k != "params"}, "params": params, "part": part, **rate})
    return out


class PartRatesMixin:
    """Trainer mixin: for an image-text-to-text model, the optimizer's groups split by part, each at its
    args.part_learning_rates rate (else training.learning_rate), and what trains said once."""

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        opt_model = self.model if model is None else model
        family = getattr(getattr(unwrapped(opt_model), "config", None), "model_type", None)
        if family not in CHECKED or getattr(self, "_parts_split", False):
            return optimizer
        names = part_of_parameters(opt_model, family)
        part_of = {id(p): names[n] for n, p in opt_model.named_parameters()}
        rates = dict(getattr(self.args, "part_learning_rates", None) or {})
        groups = _split_by_part(optimizer.param_groups, part_of, rates)
        if rates:
            self.optimizer = type(optimizer)(groups, **optimizer.defaults)
        self._parts_split = True
        say_trained_parts(opt_model, family, groups, self.args.learning_rate)
        return self.optimizer


def say_trained_parts(model, family: str, groups: list[dict], default_rate: float) -> None:
    """`hftrain: trains: language_model 123456 weights at 0.0001, projector ..., vision_tower frozen`."""
    held = {}
    for g in groups:
        count, rate = held.get(g["part"], (0, g.get("lr", default_rate)))
        held[g["part"]] = (count + sum(p.numel() for p in g["params"]), rate)
    said = [f"{part} {held[part][0]} weights at {held[part][1]:g}" if part in held else f"{part} frozen"
            for part in part_names(family)]
    print0(f"hftrain: trains: {', '.join(said)}", file=sys.stderr)
