"""model.freeze (issue 58): the vision tower and/or the projector of an image-text-to-text model left untrained, by
the names LLaMA-Factory's users know; a name the family has no part for, or the key on a text model, refused by
`hftrain check` and the run alike (exit 2)."""

from __future__ import annotations

import types

import pytest

from hftrain.config import StrategySection
from hftrain.methods import load_recipe, method_of

from .test_vision import FAMILIES, _square_rows, refusals_of_check_and_run, vlm_dirs  # noqa: F401, F811

QWEN3_VL_PROJECTORS = ("model.visual.merger.", "model.visual.deepstack_merger_list.")
# the parameter names of each part, by the family's own module paths
PARTS = {"qwen2_5_vl": {"vision_tower": lambda n: n.startswith("model.visual.") and ".merger." not in n,
                        "projector": lambda n: n.startswith("model.visual.merger.")},
         "llava": {"vision_tower": lambda n: n.startswith("model.vision_tower."),
                   "projector": lambda n: n.startswith("model.multi_modal_projector.")}}
PARTS["qwen2_vl"] = PARTS["qwen2_5_vl"]
PARTS["llava_next"] = PARTS["gemma3"] = PARTS["llava"]
PARTS["idefics3"] = {"vision_tower": lambda n: n.startswith("model.vision_model."),
                     "projector": lambda n: n.startswith("model.connector.")}
PARTS["qwen3_vl"] = PARTS["qwen3_vl_moe"] = {  # the merger and the deepstack mergers project
    "vision_tower": lambda n: n.startswith("model.visual.") and not n.startswith(QWEN3_VL_PROJECTORS),
    "projector": lambda n: n.startswith(QWEN3_VL_PROJECTORS)}


def _trainable_after_the_method_loads(folder, data, freeze) -> dict[str, bool]:
    recipe = load_recipe(None, raw={"model": {"name_or_path": folder, "dtype": "float32", "freeze": freeze},
                                    "data": {"sources": [{"path": data}]}})
    run = types.SimpleNamespace(recipe=recipe, strategy=StrategySection())
    model = method_of(recipe).model(run)  # as the run loads the policy
    return {name: p.requires_grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("freeze", [["vision_tower"], ["projector"], ["vision_tower", "projector"]])
def test_freeze_leaves_exactly_the_named_parts_untrained(vlm_dirs, tmp_path, family, freeze):  # noqa: F811
    data = _square_rows(tmp_path, 4)
    trainable = _trainable_after_the_method_loads(vlm_dirs[family], data, freeze)
    baseline = _trainable_after_the_method_loads(vlm_dirs[family], data, [])
    for part, inside in PARTS[family].items():
        names = [n for n in trainable if inside(n)]
        assert names, part
        if part in freeze:
            assert not any(trainable[n] for n in names), part
        else:  # what it was without model.freeze (LLaVA's tower above its feature layer is frozen anyway)
            assert all(trainable[n] == baseline[n] for n in names), part
    language = [n for n in trainable if n.startswith(("model.language_model.", "model.text_model.", "lm_head."))]
    assert language and all(trainable[n] for n in language)


def _refusal(tmp_path, folder, freeze, capsys, monkeypatch) -> tuple[str, str]:
    return refusals_of_check_and_run(tmp_path, folder, lambda tree: tree["model"].update(freeze=freeze), capsys,
                                     monkeypatch)


def test_a_part_the_family_does_not_have_is_refused_by_check_and_the_run(vlm_dirs, tmp_path, capsys,  # noqa: F811
                                                                         monkeypatch):
    checked, ran = _refusal(tmp_path, vlm_dirs["llava"], ["vision_tower", "aligner"], capsys, monkeypatch)
    assert checked == ran
    assert ("model.freeze.1: 'aligner' is not a part of a llava model; its parts: language_model, projector, "
            "vision_tower") in checked


def test_freeze_on_a_text_model_is_refused(tiny_model_dir, tmp_path, capsys, monkeypatch):
    checked, ran = _refusal(tmp_path, tiny_model_dir, ["vision_tower"], capsys, monkeypatch)
    assert checked == ran
    assert "model.freeze: freezes parts of an image-text-to-text model" in checked
