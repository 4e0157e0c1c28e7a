"""Vision-language fine-tuning, first slice (issue 58): tiny image-text-to-text models built locally, image rows read
and checked in the data phase, labels against each family's template oracle, the processor's expansion."""

from __future__ import annotations

import json
import os

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, Qwen2_5_VLProcessor

from hftrain.tiny import build_tiny_vision_model
from hftrain.vision.processor import load_processor

FAMILIES = ["qwen2_5_vl", "llava"]
PROCESSORS = {"qwen2_5_vl": Qwen2_5_VLProcessor, "llava": None}
WORDS = ["what colour is the square", "red", "blue", "green", "yellow", "a square on white", "describe the image"]


@pytest.fixture(scope="session")
def vlm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return {f: build_tiny_vision_model(str(root / f), WORDS * 20, f, vocab_size=320) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tiny_vlm_saves_reloads_and_runs_on_an_image(vlm_dirs, family):
    folder = vlm_dirs[family]
    processor = load_processor(folder, PROCESSORS[family])
    model = AutoModelForImageTextToText.from_pretrained(folder)
    assert model.config.model_type == family
    with open(os.path.join(folder, "processor_config.json")) as f:  # saved as the family's own class
        assert json.load(f)["processor_class"] in (Qwen2_5_VLProcessor.__name__, "LlavaProcessor")
    if family == "llava":  # AutoProcessor loads it here (Qwen-VL's needs torchvision for its video processor)
        assert type(AutoProcessor.from_pretrained(folder)).__name__ == "LlavaProcessor"
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the square"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
    text = processor.apply_chat_template(msgs, tokenize=False)
    enc = processor(text=[text], images=[Image.new("RGB", (60, 90), "red")], return_tensors="pt")
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert (enc["input_ids"] == image_id).sum() > 1  # one placeholder in the text, expanded by the processor
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(logits).all()
