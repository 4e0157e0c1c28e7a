"""Knowledge distillation in the run: the student is the policy (recipe.model, loaded as SFT loads it), the teacher
a frozen model beside it (distill.teacher: Method.load_frozen, the policy's safe path, on the student's device); the
data is SFT's (sft.read: data/'s rendered and labelled rows, the completions labelled); the trainer is trainer.py's.
Held-out: the eval loss (the student's cross-entropy on the completions), the divergence to the teacher per
completion token (each held-out row once, over every rank), and exact match where eval.exact_match asks."""

from __future__ import annotations

import torch

from ...config import HFTrainingArguments, Recipe
from ...data.preview import preview
from ...heads import Head, Role
from .. import registry
from ..base import ModelSpec
from ..sft import SFT, exact_match_metrics, read
from .trainer import DistillTrainer


@torch.no_grad()
def held_out_divergence(trainer) -> dict:
    """The divergence to the teacher per completion token of the eval set (per-row sums gathered once per row)."""
    if trainer.eval_dataset is None:
        return {}
    model = trainer.model
    was_training = model.training
    model.eval()
    sums = []
    try:
        for batch in trainer.get_eval_dataloader():
            rows = trainer.row_divergences(model, trainer._prepare_inputs(batch))
            sums.append(trainer.accelerator.gather_for_metrics(rows).cpu())
    finally:
        model.train(was_training)
    total = torch.cat(sums).sum(0)
    return {"eval_divergence": float(total[0] / total[1].clamp(min=1))}


class Distill(SFT):
    reported = ("eval_loss",)

    def models(self, recipe: Recipe) -> list[ModelSpec]:
        return [ModelSpec(Role.POLICY, Head.CAUSAL_LM, recipe.model),
                ModelSpec(Role.TEACHER, Head.CAUSAL_LM, recipe.distill.teacher, key="distill.teacher")]

    def teacher(self, recipe: Recipe) -> ModelSpec:
        return next(spec for spec in self.models(recipe) if spec.role is Role.TEACHER)

    def trainer(self, run, model, tokenizer, data, callbacks):
        teacher = self.load_frozen(self.teacher(run.recipe)).to(run.args.device)
        return self.trainer_class(model=model, args=run.args, train_dataset=data.train, eval_dataset=data.eval,
                                  processing_class=tokenizer, data_collator=data.collator, callbacks=callbacks,
                                  teacher=teacher, section=run.recipe.distill)

    def metrics(self, run, trainer, data, before):
        return {**held_out_divergence(trainer), **exact_match_metrics(run, trainer, data, before)}

    def describe(self, recipe):
        d = recipe.distill
        return (f"distillation from {d.teacher.name_or_path} ({d.mode} mode, {d.resolved_divergence}"
                + (f" beta={d.value('beta')}" if d.resolved_divergence == "jsd" else "")
                + f", temperature {d.temperature})")


METHOD = Distill(entry=registry.DISTILL, read=read,
                 show=lambda recipe, tokenizer, n: preview(recipe.data, tokenizer, n),
                 arguments=lambda recipe, **kwargs: HFTrainingArguments(**kwargs), trainer_class=DistillTrainer,
                 hub_tag="knowledge-distillation")
