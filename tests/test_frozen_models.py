"""The frozen-model contract (methods/base.py Method.models / load_others, methods/frozen.py FrozenModelsMixin): a
stand-in method outside hftrain registers a head of its own (a per-token value head, heads.Head.register) and holds a
frozen model of it beside a causal-LM policy. Without code of its own beyond declaring it, the model is loaded by its
head with the options the policy's rows need, frozen, placed by the trainer and said, counted by the memory plan as
that head's model, and a run recording the new head gets a card. Placement under FSDP2 and ZeRO-3 is the same
function the distillation teacher goes through (tests/test_distill.py checks what rank 0 holds there)."""

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForTokenClassification, Trainer, TrainingArguments

from hftrain.config import ModelSection
from hftrain.constants import RECIPE_FILE, RUN_INFO_FILE
from hftrain.heads import Head, Role
from hftrain.hub.card import build_card
from hftrain.launch.plan import model_facts
from hftrain.methods import Method, MethodEntry, ModelSpec
from hftrain.methods.frozen import FrozenModelsMixin

SCORER_KEY = "stand_in.scorer"


@pytest.fixture
def value_head():
    """A head hftrain does not ship: one value per token (TRL's PPO value model), registered for this test alone."""
    head = Head.register(Head("token_value", "AutoModelForTokenClassification", "AutoPeftModelForTokenClassification",
                              "TOKEN_CLS", "token-classification"))
    yield head
    del Head._registered[head.value]


class WithScorer(Method):
    """A causal-LM policy and, beside it, a frozen per-token scorer of the registered head."""

    head = None  # set by the test: the registered head

    def models(self, recipe):
        return [ModelSpec(Role.POLICY, Head.CAUSAL_LM, recipe.model),
                ModelSpec(Role.REWARD, self.head, recipe.scorer, key=SCORER_KEY, num_labels=1)]


class StandInTrainer(FrozenModelsMixin, Trainer):
    """The stand-in's trainer: transformers' Trainer holding the frozen models; no placement code of its own."""


def _run(tiny_model_dir, packing: bool):
    section = ModelSection(name_or_path=tiny_model_dir, dtype="float32")
    recipe = SimpleNamespace(model=section, scorer=ModelSection(name_or_path=tiny_model_dir, dtype="float32"),
                             data=SimpleNamespace(packing=packing))
    return SimpleNamespace(recipe=recipe)


def _method(head):
    method = WithScorer(MethodEntry("with_scorer", "sft", None, None, __name__), read=lambda *a: None)
    object.__setattr__(method, "head", head)
    return method


def test_a_frozen_model_of_a_registered_head_is_loaded_frozen_and_placed(tiny_model_dir, tmp_path, value_head,
                                                                         capsys):
    method, run = _method(value_head), _run(tiny_model_dir, packing=True)
    frozen = method.load_others(run)
    scorer = frozen[SCORER_KEY]
    assert list(frozen) == [SCORER_KEY] and type(scorer).__name__ == "LlamaForTokenClassification"  # by its head
    assert scorer.config.num_labels == 1  # the spec's classes, not the config's default two
    assert scorer.config.use_cache is False  # loaded for the policy's packed rows
    assert not scorer.training and not any(p.requires_grad for p in scorer.parameters())
    policy = method.model(run)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=1)
    trainer = StandInTrainer(model=policy, args=args, frozen=frozen)
    placed = trainer.frozen[SCORER_KEY]
    total = sum(p.numel() for p in scorer.parameters())
    assert f"hftrain: {SCORER_KEY}: placed by whole on each rank: rank 0 holds {total:,} of its {total:,}" in (
        capsys.readouterr().out)
    assert all(p.device == trainer.args.device for p in placed.parameters())
    assert not any(id(p) in {id(q) for q in placed.parameters()} for p in trainer.model.parameters())
    with torch.no_grad():
        assert placed(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 1)  # one value per token


def test_the_memory_plan_counts_it_as_its_head_builds_it(tiny_model_dir, value_head):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels = 1
    built = sum(p.numel() for p in AutoModelForTokenClassification.from_config(config).parameters())
    assert model_facts(tiny_model_dir, head=value_head, num_labels=1).params == built
    assert model_facts(tiny_model_dir, head=value_head).params != built  # the config's own two classes: counted apart
    assert model_facts(tiny_model_dir, head=value_head).params != model_facts(tiny_model_dir).params


def test_a_run_recording_a_registered_head_gets_its_card(tmp_path, value_head):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / RECIPE_FILE).write_text(json.dumps({"model": {"name_or_path": "base"},
                                                  "data": {"sources": [{"path": "rows.jsonl"}]}}))
    (folder / RUN_INFO_FILE).write_text(json.dumps({"method": {"name": "with_scorer", "tag": "with_scorer",
                                                               "description": "a stand-in", "head": "token_value"}}))
    card = str(build_card(str(folder), [RECIPE_FILE, RUN_INFO_FILE]))
    assert "pipeline_tag: token-classification" in card and "AutoModelForTokenClassification.from_pretrained(" in card


def test_a_head_value_is_registered_once(value_head):
    with pytest.raises(ValueError, match="a head named 'token_value' is registered already"):
        Head.register(Head("token_value", "AutoModelForCausalLM", "AutoPeftModelForCausalLM", "CAUSAL_LM",
                           "text-generation"))
    with pytest.raises(ValueError, match="run_info.json records the head 'embedding', which no installed method"):
        Head.recorded("embedding")
