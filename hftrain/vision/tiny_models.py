"""Tiny vision-language models for demos and tests (`hftrain tiny-model --vision FAMILY`, hftrain.tiny): a vision
tower, projector and language model from a tiny config with random weights, a tokenizer trained locally (by
hftrain.tiny, with the family's real chat template: TEMPLATES, TRL's copies) given the family's image tokens here,
and the family's processor with an image processor that needs PIL only, saved beside the model. Nothing touches the
Hub."""

from __future__ import annotations

import os

import torch
from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaProcessor, Qwen2_5_VLConfig,
                          Qwen2_5_VLProcessor)
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ..heads import Head
from ..modeling import chat_template_text
from .processor import images_only, needs_video_processor

QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 1024}
# Qwen2.5-VL: 14-pixel patches merged 2x2, so an image of h x w pixels (rounded to 28) is (h/28)(w/28) tokens,
# between 4 and 64 tokens here (min_pixels / max_pixels).
QWEN_PIXELS = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64}
LLAVA_SIZE = 56  # LLaVA: every image resized to 56 x 56, 14-pixel patches: 16 image tokens (the CLS token dropped)


def template(family: str) -> str:
    """The family's chat template (TRL's copy of the model's own), which the tokenizer is given."""
    return chat_template_text(TEMPLATES[family], "--vision")


def qwen2_5_vl(tokenizer):
    """(config, processor) of a tiny Qwen2.5-VL around `tokenizer`, its image tokens added."""
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    head_dim = TEXT["hidden_size"] // TEXT["num_attention_heads"]
    config = Qwen2_5_VLConfig(
        text_config=dict(TEXT, vocab_size=len(tokenizer), rope_scaling={"type": "mrope", "mrope_section": [
            head_dim // 4, head_dim // 8, head_dim // 8]}, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id, bos_token_id=None),
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "fullatt_block_indexes": [1], "window_size": 56},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    image_processor = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, **QWEN_PIXELS)
    cls = images_only(Qwen2_5_VLProcessor) if needs_video_processor(Qwen2_5_VLProcessor) else Qwen2_5_VLProcessor
    return config, cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def llava(tokenizer):
    """(config, processor) of a tiny LLaVA with the LLaVA-NeXT (Mistral) chat template around `tokenizer`, its
    image token, bos and eos added."""
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"], "bos_token": "<s>", "eos_token": "</s>"})
    config = LlavaConfig(
        text_config=LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **TEXT),
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, image_size=LLAVA_SIZE, patch_size=14,
                                       projection_dim=32),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        image_seq_length=(LLAVA_SIZE // 14) ** 2)
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": LLAVA_SIZE},
                                             crop_size={"height": LLAVA_SIZE, "width": LLAVA_SIZE})
    return config, LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                                  vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                  chat_template=tokenizer.chat_template)


BUILDERS = {"qwen2_5_vl": qwen2_5_vl, "llava": llava}
TEMPLATES = {"qwen2_5_vl": "trl:qwen2_5_vl", "llava": "trl:llava_next"}


def save_tiny_vision_model(output: str, tokenizer, family: str, seed: int = 0) -> str:
    """A tiny image-text-to-text model of `family` (BUILDERS) around `tokenizer` (trained with template(family)),
    with its processor, saved to `output`: it loads with AutoModelForImageTextToText and its processor with
    hftrain.vision.load_processor (AutoProcessor where the family's video processor can be built)."""
    config, processor = BUILDERS[family](tokenizer)
    tokenizer = processor.tokenizer
    torch.manual_seed(seed)
    model = Head.IMAGE_TEXT_TO_TEXT.auto_class.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    os.makedirs(output, exist_ok=True)
    model.save_pretrained(output, safe_serialization=True)
    processor.save_pretrained(output)
    return output
