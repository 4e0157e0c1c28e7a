"""A model's head (hftrain/heads.py) as the house uses it: each head's Auto class builds its model, the card names the
head's pipeline tag and a snippet that loads and runs the model, and a method that declares a sequence-classification
policy gets it through the house's loading path, memory plan and upload checks (tiny configs built locally; no Hub).
tests/test_architecture.py holds the other half: no module outside methods/ assumes a causal LM."""

import contextlib
import io
import json
from types import SimpleNamespace

import pytest
from transformers import AutoConfig, AutoTokenizer, CLIPVisionConfig, LlamaConfig, LlavaConfig

from hftrain.config import LoraSection, ModelSection
from hftrain.constants import RECIPE_FILE, RUN_INFO_FILE
from hftrain.errors import ModelError
from hftrain.heads import Head, Role
from hftrain.hub.card import build_card
from hftrain.hub.checks import head_of_run, validate_folder
from hftrain.launch import model_checks
from hftrain.launch.plan import model_facts
from hftrain.methods import Method, MethodEntry, ModelSpec
from hftrain.modeling import lora_config

TINY_TEXT = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1}
PIPELINE_TAGS = {Head.CAUSAL_LM: "text-generation", Head.SEQUENCE_CLASSIFICATION: "text-classification",
                 Head.TOKEN_CLASSIFICATION: "token-classification", Head.IMAGE_TEXT_TO_TEXT: "image-text-to-text"}
BUILT = {Head.CAUSAL_LM: "LlamaForCausalLM", Head.SEQUENCE_CLASSIFICATION: "LlamaForSequenceClassification",
         Head.TOKEN_CLASSIFICATION: "LlamaForTokenClassification",
         Head.IMAGE_TEXT_TO_TEXT: "LlavaForConditionalGeneration"}
TEXT_HEADS = (Head.CAUSAL_LM, Head.SEQUENCE_CLASSIFICATION, Head.TOKEN_CLASSIFICATION)


def tiny_config(head: Head):
    if head is Head.IMAGE_TEXT_TO_TEXT:
        vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=32, patch_size=16, projection_dim=16)
        return LlavaConfig(vision_config=vision, text_config=LlamaConfig(**TINY_TEXT), image_token_index=63)
    return LlamaConfig(**TINY_TEXT, num_labels=3 if head is Head.TOKEN_CLASSIFICATION else 1)


@pytest.mark.parametrize("head", Head.registered())
def test_each_head_builds_its_model_from_a_config(head):
    model = head.auto_class.from_config(tiny_config(head))
    assert type(model).__name__ == BUILT[head]
    assert model.can_generate() == head.generates
    assert Head.recorded(head.value) is head


def write_run(folder, head_value: str | None, lora: bool = False):
    """recipe.yaml and run_info.json as a run writes them, the method recording `head_value` (None: a run written
    before heads were recorded)."""
    model = {"name_or_path": "base", **({"lora": {"r": 4, "alpha": 8}} if lora else {})}
    folder.mkdir(exist_ok=True)
    (folder / RECIPE_FILE).write_text(json.dumps({"model": model, "data": {"sources": [{"path": "rows.jsonl"}]}}))
    method = {"name": "stand_in", "tag": "stand_in", "description": "a stand-in method"}
    (folder / RUN_INFO_FILE).write_text(json.dumps({"method": {**method, **({"head": head_value} if head_value
                                                                            else {})}}))
    return str(folder)


@pytest.mark.parametrize("head", Head.registered())
@pytest.mark.parametrize("lora", [False, True])
def test_the_card_names_the_heads_pipeline_tag_and_auto_class(tmp_path, head, lora):
    card = str(build_card(write_run(tmp_path / "run", head.value, lora), [RECIPE_FILE, RUN_INFO_FILE]))
    assert f"pipeline_tag: {PIPELINE_TAGS[head]}" in card
    loader = head.peft_auto_class_name if lora else head.auto_class_name
    if lora and head is Head.IMAGE_TEXT_TO_TEXT:  # peft's AutoPeftModel refuses an adapter with a task type
        loader = "PeftModel"
    assert f"model = {loader}.from_pretrained(" in card
    assert ("model.generate(" in card) == head.generates
    others = {h.auto_class_name for h in Head.registered()} - {head.auto_class_name}
    assert not any(f"{name}," in card or f"{name}.from" in card for name in others)


def test_a_run_written_before_heads_were_recorded_is_a_causal_lm(tmp_path):
    folder = write_run(tmp_path / "run", None)
    assert head_of_run(folder) is Head.CAUSAL_LM
    assert "pipeline_tag: text-generation" in str(build_card(folder, [RECIPE_FILE, RUN_INFO_FILE]))
    assert head_of_run(write_run(tmp_path / "scorer", "sequence_classification")) is Head.SEQUENCE_CLASSIFICATION


def save_with_head(folder, tiny_model_dir: str, head: Head) -> str:
    """The tiny test model with `head` (random weights for a new one) and its tokenizer, saved to `folder`."""
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels = 3 if head is Head.TOKEN_CLASSIFICATION else 1
    head.auto_class.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("head", TEXT_HEADS)
def test_the_cards_snippet_loads_and_runs_the_model(tmp_path, tiny_model_dir, head):
    folder = save_with_head(tmp_path / "model", tiny_model_dir, head)
    printed, names = io.StringIO(), {}
    with contextlib.redirect_stdout(printed):
        exec(head.usage(folder, adapter=False), names)
    assert type(names["model"]).__name__ == BUILT[head]
    assert printed.getvalue() not in ("", "\n")  # generated text (a random model's: newlines, maybe) or the logits


@pytest.mark.parametrize("head", TEXT_HEADS)
def test_the_cards_snippet_loads_and_runs_a_lora_adapter_with_its_classes(tmp_path, tiny_model_dir, head):
    """A LoRA adapter's snippet loads it onto its base with the classifier's classes: an outcome reward model (1
    label) over a causal LM's config (2 by default) failed to load ("score.weight [1, 32] there, [2, 32] here"). A
    sequence classifier is prompted as it was trained, a conversation through the chat template: the snippet's score
    is the adapted model's own on that rendering, and differs from the raw text's."""
    from peft import get_peft_model

    labels = 3 if head is Head.TOKEN_CLASSIFICATION else 1
    folder = tmp_path / "adapter"
    model = head.auto_class.from_pretrained(tiny_model_dir, num_labels=labels)
    model.config.pad_token_id = AutoTokenizer.from_pretrained(tiny_model_dir).pad_token_id
    get_peft_model(model, lora_config(ModelSection(name_or_path=tiny_model_dir, lora=LoraSection(r=4)), head)
                   ).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    printed, names = io.StringIO(), {}
    with contextlib.redirect_stdout(printed):
        exec(head.usage(str(folder), adapter=True, num_labels=None if head.generates else labels), names)
    assert type(names["model"]).__name__.startswith("PeftModelFor")
    assert head.generates or names["model"].config.num_labels == labels
    assert printed.getvalue() not in ("", "\n")
    if head is Head.SEQUENCE_CLASSIFICATION:
        tok = names["tokenizer"]
        rendered = tok.apply_chat_template(names["messages"], tokenize=False)
        assert float(printed.getvalue()) == pytest.approx(float(names["model"](**tok(
            rendered, return_tensors="pt", add_special_tokens=False)).logits[0, 0]), abs=1e-6)


class StandIn(Method):
    """A method whose policy scores sequences (a reward model's shape); the rest is Method's defaults."""

    def models(self, recipe):
        return [ModelSpec(Role.POLICY, Head.SEQUENCE_CLASSIFICATION, recipe.model)]


STAND_IN = StandIn(MethodEntry("stand_in", "sft", None, None, __name__), read=lambda *a: None)


def test_a_method_declaring_a_sequence_classifier_gets_it_through_the_house(tiny_model_dir, monkeypatch):
    loaded = []
    for head in Head.registered():
        original = head.auto_class.from_pretrained
        monkeypatch.setattr(head.auto_class, "from_pretrained",
                            lambda *a, _head=head, _original=original, **k: loaded.append(_head) or _original(*a, **k))
    recipe = SimpleNamespace(model=ModelSection(name_or_path=tiny_model_dir, dtype="float32"))
    model = STAND_IN.model(SimpleNamespace(recipe=recipe))
    assert loaded == [Head.SEQUENCE_CLASSIFICATION]
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert STAND_IN.card(recipe)["head"] == "sequence_classification"  # run_info.json records it for the push


def test_the_memory_plan_counts_the_heads_parameters(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    for head in TEXT_HEADS:
        expected = sum(p.numel() for p in head.auto_class.from_config(config).parameters())
        assert model_facts(tiny_model_dir, head=head).params == expected
    assert model_facts(tiny_model_dir).params != model_facts(tiny_model_dir, head=Head.SEQUENCE_CLASSIFICATION).params


def test_the_upload_checks_load_a_sequence_classifier_by_its_head(tmp_path, tiny_model_dir):
    folder = save_with_head(tmp_path / "scorer", tiny_model_dir, Head.SEQUENCE_CLASSIFICATION)
    assert validate_folder(folder, head=Head.SEQUENCE_CLASSIFICATION) == []  # no generate(), no generation_config
    assert validate_folder(folder) != []  # judged as a causal LM, its weights are not a causal LM's


def test_a_lora_policy_with_a_classification_head_trains_and_saves_its_head(tiny_model_dir):
    """peft's task type follows the head: a sequence classifier's adapter keeps its score head trainable (peft's
    modules_to_save), where a causal LM's task type would leave it frozen at its random start."""
    section = ModelSection(name_or_path=tiny_model_dir, dtype="float32", lora=LoraSection(r=4, alpha=8))
    model = STAND_IN.model(SimpleNamespace(recipe=SimpleNamespace(model=section)))
    assert type(model).__name__ == "PeftModelForSequenceClassification"
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert any(".score." in name and "modules_to_save" in name for name in trained), trained


class WithTeacher(Method):
    """A method holding a causal-LM teacher beside its policy (a distillation's shape)."""

    def models(self, recipe):
        return [ModelSpec(Role.POLICY, Head.CAUSAL_LM, recipe.model),
                ModelSpec(Role.TEACHER, Head.CAUSAL_LM, recipe.teacher, key="distill.teacher")]


WITH_TEACHER = WithTeacher(MethodEntry("with_teacher", "sft", None, None, __name__), read=lambda *a: None)


def test_a_teacher_s_path_is_checked_under_its_own_key_before_anything_loads(tmp_path, tiny_model_dir, monkeypatch):
    missing = str(tmp_path / "no-such-teacher")
    recipe = SimpleNamespace(model=ModelSection(name_or_path=tiny_model_dir),
                             teacher=ModelSection(name_or_path=missing))
    monkeypatch.setattr(model_checks, "method_of", lambda r: WITH_TEACHER)
    problems = model_checks.other_model_problems(recipe)
    assert [key for key, _ in problems] == ["distill.teacher.name_or_path"] and missing in problems[0][1]
    recipe.teacher = ModelSection(name_or_path=tiny_model_dir)
    assert model_checks.other_model_problems(recipe) == []


def test_a_frozen_model_loads_in_eval_mode_without_gradients(tiny_model_dir):
    teacher = WITH_TEACHER.load_frozen(ModelSpec(Role.TEACHER, Head.CAUSAL_LM,
                                                 ModelSection(name_or_path=tiny_model_dir, dtype="float32")))
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    with pytest.raises(ModelError, match="^distill.teacher.name_or_path: "):
        WITH_TEACHER.load_frozen(ModelSpec(Role.TEACHER, Head.CAUSAL_LM, ModelSection(name_or_path="./nope"),
                                           key="distill.teacher"))
