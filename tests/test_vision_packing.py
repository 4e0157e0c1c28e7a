"""Packed image rows (issue 58, item 4): several examples with their images in one row, none attending to another,
each with its own positions (Qwen-VL: mrope [4, B, L] restarted per example), give the padded batch's loss and each
example's loss (fp32, within named bounds); the ways it goes silently wrong are seen to differ."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForImageTextToText

from hftrain.losses import maths as losses
from hftrain.vision.families import CHECKED
from hftrain.vision.image_batches import ImageRows
from hftrain.vision.packing import PackedImageRows, example_spans, pack_image_rows, restarted_mrope
from tests.exactness import beyond, within

from .test_vision import (FAMILIES, _examples, _square_rows, _write, image_dir, part_rows,  # noqa: F401
                          refusals_of_check_and_run, vlm_dirs)


def _long_row() -> dict:
    """Four turns, four images of three sizes: the longest row, so that the others pack in rows of its length."""
    turns = []
    for image, answer in [("red.png", "red"), ("blue.png", "blue"), ("green.png", "green"), ("red.png", "red")]:
        turns += [{"role": "user", "content": [{"type": "image", "image": image},
                                               {"type": "text", "text": "what colour is the square"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
    return {"messages": turns}


def _rows(folder, family, tmp_path):
    """Eight rows of one image of four sizes, two of one and two images (other sizes, a two-turn row), a long row of
    four images."""
    squares = _square_rows(tmp_path, 8)
    more = [json.loads(line) for line in open(squares)] + part_rows() + [_long_row()]
    processor, data = _examples(folder, family, _write(tmp_path / "rows.jsonl", more), eval_fraction=0.0)
    return processor, [data.train[i] for i in range(len(data.train))]


def _sums(model, batch, segments: torch.Tensor | None = None, **call) -> torch.Tensor:
    """Per-example (CE sum, targets), in the batch's order of examples (losses.example_sums); `segments`: the
    packed batch's own position ids where the model is given others."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**inputs, **call).logits
    return losses.example_sums(logits, batch["labels"], batch.get("position_ids") if segments is None else segments)


def _loss(sums: torch.Tensor) -> float:
    return float(sums[:, 0].sum() / sums[:, 1].sum())


def _model(folder):
    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_loss_equals_padded_loss(vlm_dirs, image_dir, tmp_path, family):  # noqa: F811
    """Packed rows give the padded loss, family by family; where they do not (Gemma 3), they are measured to differ
    and the recipe is refused (test_packing_a_family_not_exact_is_refused_by_check_and_the_run)."""
    processor, rows = _rows(vlm_dirs[family], family, image_dir)
    padded, packed = ImageRows(processor)(rows), PackedImageRows(processor)(rows)
    assert packed["input_ids"].shape[0] < len(rows) and "attention_mask" not in packed  # really packed
    assert max(len(s) for s in example_spans(packed["position_ids"])) >= 3
    model = _model(vlm_dirs[family])
    reference = _sums(model, padded)
    pack_image_rows(model)
    got = _sums(model, packed)
    if CHECKED[family].packing_refused:
        beyond("vision.packed_vs_padded.loss", _loss(got), _loss(reference), label="refused as not exact")
        return
    assert len(got) == len(rows)  # each example once, the rows' padding sequences without targets dropped
    within("vision.packed_vs_padded.loss", _loss(got), _loss(reference))
    # each example's own loss, whatever its place in a row (the packed rows reorder the examples), and its targets
    ordered = [sorted(got[:, 0].tolist()), sorted(reference[:, 0].tolist())]
    within("vision.packed_vs_padded.example_losses", *ordered)
    assert sorted(got[:, 1].tolist()) == sorted(reference[:, 1].tolist())  # target counts: exact
    for name, wrong in controls(family, vlm_dirs[family], packed).items():
        print(family, name, abs(_loss(wrong) / _loss(reference) - 1), abs(_loss(got) / _loss(reference) - 1))
        beyond("vision.packed_vs_padded.loss", _loss(wrong), _loss(reference), label=name)
        beyond("vision.packed_vs_padded.example_losses", sorted(wrong[:, 0].tolist()), ordered[1], label=name)
    if family.startswith("qwen"):
        within("vision.packed_vs_padded.loss", _loss(shifted_mrope(model, packed)), _loss(reference),
               label="mrope rows shifted")
    if family.startswith("qwen"):  # without the token types the hooks cannot find the images: refused, never guessed
        with pytest.raises(ValueError, match="mm_token_type_ids"):
            _sums(model, {k: v for k, v in packed.items() if k != "mm_token_type_ids"})


def controls(family, folder, packed) -> dict[str, torch.Tensor]:
    """The packed batch through the model the ways that are silently wrong (FEASIBILITY.md, round 5)."""
    plain = _model(folder)  # no hooks: the batch as it comes, the model's defaults (its text config's use_cache)
    text = packed["position_ids"]
    if not family.startswith("qwen"):  # no mrope
        continuous = torch.arange(text.shape[1]).expand_as(text)
        return {"the cache on": _sums(plain, packed),
                "positions not restarted": _sums(plain, {**packed, "position_ids": continuous}, text, use_cache=False)}
    right = restarted_mrope(plain.model, packed["input_ids"], text, packed["mm_token_type_ids"],
                            packed["image_grid_thw"])
    no_positions = {k: v for k, v in packed.items() if k != "position_ids"}
    return {"the cache on": _sums(plain, {**packed, "position_ids": right}, text),
            "2-D position ids": _sums(plain, packed, use_cache=False),
            "no position ids": _sums(plain, no_positions, text, use_cache=False)}


def shifted_mrope(model, packed) -> torch.Tensor:
    """The mrope rows of one get_rope_index over each whole packed row (each example's rows shifted by where it
    starts) and the text row restarted: equal, as rotary attention sees only differences of positions within an
    example (the mask comes from the text row). So the text row must restart; the mrope rows must be each example's
    own up to a shift (the 2-D control above is what goes wrong)."""
    whole = model.model.get_rope_index(packed["input_ids"], packed["mm_token_type_ids"],
                                 image_grid_thw=packed["image_grid_thw"])[0]
    text = packed["position_ids"]
    spans = example_spans(text)
    assert all(whole[0, r, spans[r][1][0]] > 0 for r in range(len(spans)) if len(spans[r]) > 1)  # not restarted
    return _sums(model, {**packed, "position_ids": torch.cat([text[None], whole])}, text, use_cache=False)




@pytest.mark.parametrize("feature_layer", [-1, -2])
def test_the_llava_parameters_frozen_are_those_without_a_gradient(vlm_dirs, image_dir, feature_layer):  # noqa: F811
    """hftrain freezes LLaVA's vision tower parameters above its feature layer (DDP would wait for their gradients):
    exactly those that get no gradient from a backward; none of Qwen2.5-VL's."""
    from hftrain.vision.unreached import freeze_unreached, unreached_vision_parameters

    processor, rows = _rows(vlm_dirs["llava"], "llava", image_dir)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dirs["llava"], vision_feature_layer=feature_layer)
    batch = ImageRows(processor)(rows[:3])
    model(**batch).loss.backward()
    without = sorted(n for n, p in model.named_parameters() if p.grad is None)
    assert without and without == unreached_vision_parameters(model)
    assert freeze_unreached(model) == without and not any(p.requires_grad for n, p in model.named_parameters()
                                                          if n in without)
    assert unreached_vision_parameters(_model(vlm_dirs["qwen2_5_vl"])) == []


def test_packing_a_family_not_exact_is_refused_by_check_and_the_run(vlm_dirs, tmp_path, capsys, monkeypatch):  # noqa: F811
    checked, ran = refusals_of_check_and_run(tmp_path, vlm_dirs["gemma3"],
                                             lambda tree: tree["data"].update(packing=True), capsys, monkeypatch)
    for err in (checked, ran):
        assert "data.packing: Gemma 3 builds the mask of each image's tokens" in err
        assert "set data.packing: false" in err
