"""Held-out exact match for image rows (issue 58): a held-out image conversation carries its images to the generation,
its prompt rendered as the family's processor renders it, and eval.exact_match counts greedy answers as for text."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForImageTextToText

from hftrain.evaluate import exact_match
from hftrain.vision.image_answers import image_prompt_inputs
from hftrain.vision.image_datasets import build_image_datasets
from hftrain.vision.processor import load_processor

from .test_vision import FAMILIES, PROCESSORS, _data, _square_rows, vlm_dirs  # noqa: F401, F811


def _held_out(folder, family, tmp_path, n):
    processor = load_processor(folder, PROCESSORS[family])
    cfg = _data(_square_rows(tmp_path, 8), eval_fraction=0.5, max_length=256)
    return processor, build_image_datasets(cfg, processor, seed=0, exact_match=n).eval_examples


def _hub_prompt(example: dict) -> list[dict]:
    """The held-out prompt as the Hub's processors take it: each image part naming its file."""
    paths = iter(example["images"])
    return [{"role": m["role"], "content": [{"type": "image", "image": next(paths)} if p["type"] == "image" else p
                                            for p in m["content"]]} for m in example["messages"]]


@pytest.mark.parametrize("family", FAMILIES)
def test_an_image_eval_example_carries_its_images_and_renders_as_the_processor(vlm_dirs, tmp_path, family):  # noqa: F811
    processor, examples = _held_out(vlm_dirs[family], family, tmp_path, 3)
    assert len(examples) == 3  # eval.exact_match: the first 3 of the 4 held-out rows
    for e in examples:
        assert [m["role"] for m in e["messages"]] == ["user"] and e["reference"] in ("red", "blue", "green", "yellow")
        assert len(e["images"]) == 1 and os.path.isfile(e["images"][0])
        ours = image_prompt_inputs(processor, e)
        theirs = processor.apply_chat_template(_hub_prompt(e), add_generation_prompt=True, tokenize=True,
                                               return_dict=True, return_tensors="pt")
        assert set(ours) == set(theirs) - {"attention_mask"} and "pixel_values" in ours
        for key, value in ours.items():
            assert torch.equal(value, theirs[key]), key


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_match_of_image_rows_is_the_count_by_hand(vlm_dirs, tmp_path, family):  # noqa: F811
    folder = vlm_dirs[family]
    processor, examples = _held_out(folder, family, tmp_path, 4)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    by_hand = []
    for e in examples:  # greedy answers from the processor's own rendering of the prompt with its image
        enc = processor.apply_chat_template(_hub_prompt(e), add_generation_prompt=True, tokenize=True,
                                            return_dict=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=4, do_sample=False)
        by_hand.append(processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    # three references are the answers found by hand, one is not: 3 / 4
    marked = [dict(e, reference=said) for e, said in zip(examples, by_hand[:3])] + [
        dict(examples[3], reference=by_hand[3] + " not")]
    assert exact_match(model, processor, marked, max_new_tokens=4) == pytest.approx(0.75)
    assert model.training is False


@pytest.mark.launches
def test_the_vision_demo_recipe_reports_held_out_exact_match(tmp_path):
    """The shipped demo (recipes/demo/vision.yaml, its data and images) runs as its header says, cut to a few
    steps: the run measures held-out exact match on image rows before and after training."""
    from .conftest import REPO, run

    base, out = str(tmp_path / "base"), str(tmp_path / "out")
    done = run([".venv/bin/hftrain", "tiny-model", "--vision", "qwen2_5_vl", "--data",
                "data/demo/vision_train.jsonl", "--output", base], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    done = run([".venv/bin/hftrain", "sft", os.path.join(REPO, "recipes/demo/vision.yaml"),
                f"model.name_or_path={base}", f"training.output_dir={out}", "training.max_steps=2",
                "eval.exact_match=6"], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert "360 training examples, 60 held out" in said and "hftrain: exact_match: before " in said
    with open(os.path.join(out, "run_info.json")) as f:
        metrics = json.load(f)["metrics"]
    assert {"initial_exact_match", "final_exact_match"} <= set(metrics)
