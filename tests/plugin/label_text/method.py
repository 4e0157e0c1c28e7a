"""The stand-in method: its models (a sequence classifier as the policy), its data phase and its trainer
(transformers' Trainer with hftrain's run mixins)."""

import json
from types import SimpleNamespace

from datasets import Dataset
from transformers import DataCollatorWithPadding, Trainer

from hftrain.config import HFTrainingArguments
from hftrain.errors import DataError
from hftrain.heads import Head, Role
from hftrain.methods.base import Method, ModelSpec
from hftrain.trainer import RUN_MIXINS

from . import ENTRY


class LabelTextTrainer(*RUN_MIXINS, Trainer):
    """transformers' Trainer with hftrain's checkpoints and guards."""


def read(recipe, tokenizer, world_size, seed):
    section = recipe.label_text
    rows = []
    for source in recipe.data.sources:
        with open(source.path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                row = json.loads(line)
                if section.label_column not in row:
                    raise DataError(f"{source.path}: row {n}: no {section.label_column!r}")
                ids = tokenizer(row[section.text_column], truncation=True, max_length=recipe.data.max_length)
                rows.append({**ids, "labels": int(row[section.label_column])})
    return SimpleNamespace(train=Dataset.from_list(rows), eval=None, collator=DataCollatorWithPadding(tokenizer))


class LabelText(Method):
    def models(self, recipe):
        return [ModelSpec(Role.POLICY, Head.SEQUENCE_CLASSIFICATION, recipe.model)]

    def trainer(self, run, model, tokenizer, data, callbacks):
        return self.trainer_class(model=model, args=run.args, train_dataset=data.train, processing_class=tokenizer,
                                  data_collator=data.collator, callbacks=callbacks)


METHOD = LabelText(entry=ENTRY, read=read, unit="texts", arguments=lambda recipe, **kw: HFTrainingArguments(**kw),
                   trainer_class=LabelTextTrainer)
