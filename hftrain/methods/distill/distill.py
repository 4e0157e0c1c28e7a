"""Knowledge distillation in the run: the student is the policy (recipe.model, loaded as SFT loads it), the teacher
a frozen model beside it (distill.teacher: Method.load_frozen, the policy's safe path, on the student's device); the
data is SFT's (sft.read: data/'s rendered and labelled rows, the completions labelled); the trainer is trainer.py's.
Held-out: the eval loss is the divergence to the teacher per completion token (each held-out row once, over every
rank: the trainer's evaluation, at every evaluation), eval_ce the student's cross-entropy on the completions, and
exact match where eval.exact_match asks."""

from __future__ import annotations

from ...config import HFTrainingArguments, Recipe
from ...data.preview import preview
from ...heads import Head, Role
from .. import registry
from ..base import ModelSpec
from ..sft import SFT, exact_match_metrics, read
from .distill_section import TEACHER_KEY
from .trainer import DistillTrainer


class Distill(SFT):
    reported = ("eval_loss", "eval_ce")  # the divergence to the teacher per completion token; the student's CE

    def models(self, recipe: Recipe) -> list[ModelSpec]:
        return [ModelSpec(Role.POLICY, Head.CAUSAL_LM, recipe.model),
                ModelSpec(Role.TEACHER, Head.CAUSAL_LM, recipe.distill.teacher, key=TEACHER_KEY)]

    def trainer(self, run, model, tokenizer, data, callbacks):
        # fed the student's rows, packed or not; placed by the trainer (methods/frozen.py)
        teacher = self.load_others(run)[TEACHER_KEY]
        return self.trainer_class(model=model, args=run.args, train_dataset=data.train, eval_dataset=data.eval,
                                  processing_class=tokenizer, data_collator=data.collator, callbacks=callbacks,
                                  teacher=teacher, section=run.recipe.distill)

    def metrics(self, run, trainer, data, before):
        return exact_match_metrics(run, trainer, data, before)

    def describe(self, recipe):
        d = recipe.distill
        return (f"distillation from {d.teacher.name_or_path} ({d.mode} mode, {d.resolved_divergence}"
                + (f" beta={d.value('beta')}" if d.resolved_divergence == "jsd" else "")
                + f", temperature {d.temperature})")


METHOD = Distill(entry=registry.DISTILL, read=read,
                 show=lambda recipe, tokenizer, n: preview(recipe.data, tokenizer, n),
                 arguments=lambda recipe, **kwargs: HFTrainingArguments(**kwargs), trainer_class=DistillTrainer,
                 hub_tag="knowledge-distillation")
