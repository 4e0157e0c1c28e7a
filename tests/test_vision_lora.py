"""LoRA on an image-text-to-text model (issue 58): the language model alone is adapted by default, whatever
target_modules says; model.lora.vision_parts adds the projector and/or the vision tower (the parts model.freeze
names); what cannot be honoured is refused by `hftrain check` and the run alike (exit 2)."""

from __future__ import annotations

import types

import pytest
import torch
import yaml

from hftrain.config import LoraSection, ModelSection, StrategySection
from hftrain.methods import load_recipe, method_of
from hftrain.vision.lora_parts import lora_part_problems
from tests.exactness import beyond, within

from .test_vision import FAMILIES, _recipe, _square_rows, refusals_of_check_and_run, vlm_dirs  # noqa: F401, F811
from .test_vision_freeze import PARTS


def _language_model(name: str) -> bool:
    return name.startswith(("model.language_model.", "model.text_model."))  # Idefics3: text_model


def _loaded_with_lora(folder, data, lora) -> torch.nn.Module:
    recipe = load_recipe(None, raw={"model": {"name_or_path": folder, "dtype": "float32", "lora": lora},
                                    "data": {"sources": [{"path": data}]}})
    run = types.SimpleNamespace(recipe=recipe, strategy=StrategySection())
    return method_of(recipe).model(run)  # as the run loads the policy


def _adapted(model) -> set[str]:
    """The module names (the family's own paths) that carry a LoRA adapter."""
    return {name for name, module in model.get_base_model().named_modules() if hasattr(module, "lora_A")}


def _linear(model) -> set[str]:
    """The module names of the family's linear layers (before LoRA: a LoRA layer's base layer is one)."""
    base = model.get_base_model()
    return {name for name, module in base.named_modules()
            if hasattr(module, "lora_A") or (isinstance(module, torch.nn.Linear) and ".lora_" not in name
                                             and not name.endswith(".base_layer"))}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("vision_parts", [[], ["projector"], ["vision_tower"], ["vision_tower", "projector"]])
def test_lora_adapts_the_language_model_and_exactly_the_named_parts(vlm_dirs, tmp_path, family, vision_parts):  # noqa: F811
    if family == "gemma3" and "projector" in vision_parts:  # a matrix and a norm: refused, the rest adapted
        section = ModelSection(name_or_path=vlm_dirs[family], lora=LoraSection(r=4, vision_parts=vision_parts))
        k = vision_parts.index("projector")
        assert lora_part_problems(section) == [(f"model.lora.vision_parts.{k}", "Gemma 3's projector is a projection "
                                                "matrix and a norm, no linear layer: LoRA has nothing to adapt there; "
                                                "remove it (its weights stay as they are)")]
        vision_parts = [p for p in vision_parts if p != "projector"]
    model = _loaded_with_lora(vlm_dirs[family], _square_rows(tmp_path, 4), {"r": 4, "vision_parts": vision_parts})
    adapted, linear = _adapted(model), _linear(model)
    language = {n for n in linear if _language_model(n)}
    assert language and language <= adapted  # all-linear: every linear layer of the language model
    assert "lm_head" not in adapted
    for part, inside in PARTS[family].items():
        in_part = {n for n in linear if inside(n + ".")}
        assert in_part or (family, part) == ("gemma3", "projector"), part
        if part in vision_parts:
            assert in_part <= adapted, (part, sorted(in_part - adapted))
        else:
            assert not in_part & adapted, (part, sorted(in_part & adapted))
    others = adapted - language - {n for inside in PARTS[family].values() for n in adapted if inside(n + ".")}
    assert not others, sorted(others)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)  # peft: only the adapters train


def test_a_name_list_reaching_the_vision_tower_is_kept_to_the_language_model(vlm_dirs, tmp_path):  # noqa: F811
    """LLaVA's CLIP tower has q_proj / v_proj as its language model has: by default only the latter are adapted."""
    model = _loaded_with_lora(vlm_dirs["llava"], _square_rows(tmp_path, 4), {"r": 4, "target_modules": ["q_proj"]})
    adapted = _adapted(model)
    assert adapted and all(_language_model(n) and n.endswith(".q_proj") for n in adapted), sorted(adapted)


def _refusal(tmp_path, folder, model_keys, capsys, monkeypatch) -> tuple[str, str]:
    return refusals_of_check_and_run(tmp_path, folder, lambda tree: tree["model"].update(model_keys), capsys,
                                     monkeypatch)


def test_what_vision_parts_cannot_honour_is_refused_by_check_and_the_run(vlm_dirs, tmp_path, capsys,  # noqa: F811
                                                                         monkeypatch):
    lora = {"vision_parts": ["projector", "aligner"], "target_modules": ["q_proj", "v_proj"]}
    checked, ran = _refusal(tmp_path, vlm_dirs["qwen2_5_vl"], {"freeze": ["projector"], "lora": lora}, capsys,
                            monkeypatch)
    assert checked == ran
    assert "model.lora.vision_parts.0: 'projector' is in model.freeze too" in checked
    assert "model.lora.vision_parts.1: 'aligner' is not a part of a qwen2_5_vl model; its parts: projector, " \
           "vision_tower" in checked
    assert "model.lora.vision_parts: adapts every linear layer of the parts it names, which needs " \
           "model.lora.target_modules: all-linear" in checked


def test_vision_parts_on_a_text_model_is_refused(tiny_model_dir, tmp_path, capsys, monkeypatch):
    checked, ran = _refusal(tmp_path, tiny_model_dir, {"lora": {"vision_parts": ["projector"]}}, capsys, monkeypatch)
    assert checked == ran
    assert "model.lora.vision_parts: adapts parts of an image-text-to-text model" in checked


def test_a_lora_run_saves_an_adapter_that_loads_back_and_merges(vlm_dirs, tmp_path, monkeypatch):  # noqa: F811
    """A LoRA run on a tiny Qwen2.5-VL with the projector adapted (in process): the adapter saved holds the language
    model's and the projector's adapters only, loads back onto the base with peft, and the merged model saved beside
    it (model.lora.merge) loads with AutoModelForImageTextToText and gives the adapter's logits on an image row."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText
    from safetensors.torch import load_file

    from .test_bad_input import run_main
    from .test_vision import _examples

    folder, out = vlm_dirs["qwen2_5_vl"], tmp_path / "out"
    data = _square_rows(tmp_path)
    recipe = _recipe(tmp_path, folder, data, str(out), learning_rate=1e-2)
    tree = yaml.safe_load(open(recipe))
    tree["model"]["lora"] = {"r": 4, "vision_parts": ["projector"], "merge": True}
    yaml.safe_dump(tree, open(recipe, "w"))
    assert run_main([recipe], {}, monkeypatch) == 0
    saved = load_file(out / "adapter_model.safetensors")
    assert any(".language_model." in k for k in saved) and any(".visual.merger." in k for k in saved)
    assert not [k for k in saved if ".visual." in k and ".merger." not in k]  # the vision tower: no adapter
    base = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(out)).eval()
    merged = AutoModelForImageTextToText.from_pretrained(out / "merged", dtype=torch.float32).eval()
    _, examples = _examples(folder, "qwen2_5_vl", data, eval_fraction=0.0)
    batch = {k: v for k, v in examples.collator([examples.train[0]]).items() if k != "labels"}
    with torch.no_grad():
        with adapted.disable_adapter():
            before = adapted(**batch).logits
        after, whole = adapted(**batch).logits, merged(**batch).logits
    assert not torch.allclose(before, after)  # the adapter trained
    within("vision.lora_merged_vs_adapted.logits", whole, after)
    beyond("vision.lora_merged_vs_adapted.logits", before, after)  # a merge that lost the adapter would be seen
    # merged/ is a whole model with its processor (it held the tokenizer only), and the card's adapter snippet
    # (PeftModel over the base: AutoPeftModel refuses an adapter with a task type) loads the adapter
    from hftrain.heads import Head
    from hftrain.vision.processor import load_processor

    assert type(load_processor(str(out / "merged"))).__name__ == "Qwen2_5_VLProcessor"
    snippet = Head.IMAGE_TEXT_TO_TEXT.usage(str(out), adapter=True)
    names = {}
    exec(snippet.split("processor = ")[0], names)  # the loading lines; AutoProcessor needs torchvision for Qwen-VL
    assert type(names["model"]).__name__.startswith("PeftModel")  # peft picks its task type's class
