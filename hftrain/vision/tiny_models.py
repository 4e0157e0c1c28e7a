"""Tiny vision-language models for demos and tests (`hftrain tiny-model --vision FAMILY`, hftrain.tiny): a vision
tower, projector and language model from a tiny config with random weights, a tokenizer trained locally (by
hftrain.tiny, with the family's real chat template: TEMPLATES, TRL's copies) given the family's image tokens here,
and the family's processor with an image processor that needs PIL only, saved beside the model. Nothing touches the
Hub."""

from __future__ import annotations

import os

import torch
from transformers import (CLIPVisionConfig, Gemma3Config, Gemma3Processor, Gemma3TextConfig, Idefics3Config,
                          Idefics3Processor, LlamaConfig,
                          LlavaConfig, LlavaNextConfig, LlavaNextProcessor, LlavaProcessor, Qwen2_5_VLConfig,
                          Qwen2_5_VLProcessor, Qwen2VLConfig, Qwen2VLProcessor, Qwen3VLConfig, Qwen3VLMoeConfig,
                          Qwen3VLProcessor,
                          SiglipVisionConfig)
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ..heads import Head
from ..modeling import chat_template_text
from .processor import images_only, needs_video_processor

QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 1024}
LLAVA_SIZE = 56  # LLaVA: every image resized to 56 x 56, 14-pixel patches: 16 image tokens (the CLS token dropped)


def template(family: str) -> str:
    """The family's chat template (TRL's copy of the model's own), which the tokenizer is given."""
    return chat_template_text(TEMPLATES[family], "--vision")


def _qwen_vl_tokens(tokenizer) -> dict:
    """Qwen-VL's image tokens added to `tokenizer`: the config's token ids."""
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def _qwen_text(tokenizer, **more) -> dict:
    return dict(TEXT, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **more)


def _qwen_vl_processor(processor_class, tokenizer, patch: int):
    """A Qwen-VL processor of `patch`-pixel patches merged 2 x 2 (images only where the video processor needs
    torchvision): an image of h x w pixels (rounded to 2 x patch) is (h / 2patch)(w / 2patch) tokens, 4 to 64."""
    image_processor = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                               min_pixels=(2 * patch) ** 2 * 4, max_pixels=(2 * patch) ** 2 * 64)
    cls = images_only(processor_class) if needs_video_processor(processor_class) else processor_class
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def _mrope(head_dim: int) -> list[int]:
    return [head_dim // 4, head_dim // 8, head_dim // 8]


def qwen2_5_vl(tokenizer):
    """(config, processor) of a tiny Qwen2.5-VL around `tokenizer`, its image tokens added."""
    tokens = _qwen_vl_tokens(tokenizer)
    head_dim = TEXT["hidden_size"] // TEXT["num_attention_heads"]
    config = Qwen2_5_VLConfig(
        text_config=_qwen_text(tokenizer, rope_scaling={"type": "mrope", "mrope_section": _mrope(head_dim)}),
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "fullatt_block_indexes": [1], "window_size": 56}, **tokens)
    return config, _qwen_vl_processor(Qwen2_5_VLProcessor, tokenizer, 14)


def qwen2_vl(tokenizer):
    """(config, processor) of a tiny Qwen2-VL (the vision tower without windows, a patch merger) around
    `tokenizer`, its image tokens added."""
    tokens = _qwen_vl_tokens(tokenizer)
    head_dim = TEXT["hidden_size"] // TEXT["num_attention_heads"]
    config = Qwen2VLConfig(
        text_config=_qwen_text(tokenizer, rope_scaling={"type": "mrope", "mrope_section": _mrope(head_dim)}),
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2, "num_heads": 2,
                       "patch_size": 14, "spatial_merge_size": 2}, **tokens)
    return config, _qwen_vl_processor(Qwen2VLProcessor, tokenizer, 14)


def _qwen3_vl(config_class, tokenizer, **text):
    """(config, processor) of a tiny Qwen3-VL-style model (16-pixel patches, interleaved mrope, one deepstack layer)
    of `config_class` around `tokenizer`, its image tokens added; `text`: more of its language model's config."""
    tokens = _qwen_vl_tokens(tokenizer)
    head_dim = TEXT["hidden_size"] // TEXT["num_attention_heads"]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _mrope(head_dim), "mrope_interleaved": True}
    config = config_class(
        text_config=_qwen_text(tokenizer, head_dim=head_dim, rope_parameters=rope, **text),
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 16, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}, **tokens)
    return config, _qwen_vl_processor(Qwen3VLProcessor, tokenizer, 16)


def qwen3_vl(tokenizer):
    """(config, processor) of a tiny Qwen3-VL around `tokenizer`."""
    return _qwen3_vl(Qwen3VLConfig, tokenizer)


def qwen3_vl_moe(tokenizer):
    """(config, processor) of a tiny Qwen3-VL-MoE (Qwen3-VL's tower; a language model of 4 experts, 2 per token, in
    every layer) around `tokenizer`."""
    return _qwen3_vl(Qwen3VLMoeConfig, tokenizer, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     decoder_sparse_step=1, tie_word_embeddings=False)


def _llava_tokens(tokenizer) -> None:
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"], "bos_token": "<s>", "eos_token": "</s>"})


def _llama_text(tokenizer) -> LlamaConfig:
    return LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **TEXT)


def _clip_tower() -> CLIPVisionConfig:
    return CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            image_size=LLAVA_SIZE, patch_size=14, projection_dim=32)


def llava(tokenizer):
    """(config, processor) of a tiny LLaVA with the LLaVA-NeXT (Mistral) chat template around `tokenizer`, its
    image token, bos and eos added."""
    _llava_tokens(tokenizer)
    config = LlavaConfig(text_config=_llama_text(tokenizer), vision_config=_clip_tower(),
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
                         image_seq_length=(LLAVA_SIZE // 14) ** 2)
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": LLAVA_SIZE},
                                             crop_size={"height": LLAVA_SIZE, "width": LLAVA_SIZE})
    return config, LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                                  vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                  chat_template=tokenizer.chat_template)


# LLaVA-NeXT: each image is a 56 x 56 overview plus the tiles of the grid (of 56-pixel tiles) its aspect fits best,
# with a newline token per row of features: between 52 and 72 tokens here, by the image's size.
LLAVA_NEXT_GRIDS = [[LLAVA_SIZE, 2 * LLAVA_SIZE], [2 * LLAVA_SIZE, LLAVA_SIZE], [2 * LLAVA_SIZE, 2 * LLAVA_SIZE]]


def llava_next(tokenizer):
    """(config, processor) of a tiny LLaVA-NeXT (any-resolution tiles) around `tokenizer`, its image token, bos
    and eos added."""
    _llava_tokens(tokenizer)
    config = LlavaNextConfig(text_config=_llama_text(tokenizer), vision_config=_clip_tower(),
                             image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
                             image_grid_pinpoints=LLAVA_NEXT_GRIDS, image_seq_length=(LLAVA_SIZE // 14) ** 2)
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": LLAVA_SIZE},
                                                 crop_size={"height": LLAVA_SIZE, "width": LLAVA_SIZE},
                                                 image_grid_pinpoints=LLAVA_NEXT_GRIDS)
    return config, LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                                      vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                      chat_template=tokenizer.chat_template)


IDEFICS3_TILES = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]


def idefics3(tokenizer):
    """(config, processor) of a tiny Idefics3 (SmolVLM's architecture: a SigLIP tower, pixel shuffle, each image split
    into 56 x 56 tiles up to 112 pixels a side plus a whole view, each 4 tokens between its tile tokens) around
    `tokenizer`, its image, tile and turn tokens added."""
    tokenizer.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                                "<end_of_utterance>", "<global-img>",
                                                                *IDEFICS3_TILES],
                                  "bos_token": "<|begin_of_text|>", "eos_token": "<end_of_utterance>"})
    config = Idefics3Config(text_config=_llama_text(tokenizer),
                            vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                           "num_attention_heads": 2, "image_size": LLAVA_SIZE, "patch_size": 14},
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=2)
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 2 * LLAVA_SIZE},
                                                max_image_size={"longest_edge": LLAVA_SIZE}, do_image_splitting=True)
    return config, Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                     chat_template=tokenizer.chat_template)


GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
GEMMA3_IMAGE_TOKENS = 4  # a 56 x 56 image, 14-pixel patches (16) pooled to 4 tokens (Gemma 3 itself: 896 -> 256)


def gemma3(tokenizer):
    """(config, processor) of a tiny Gemma 3 (a SigLIP tower without its pooling head, images pooled to
    GEMMA3_IMAGE_TOKENS tokens, each image's tokens attending to each other both ways) around `tokenizer`, its turn
    and image tokens added as the processor reads them."""
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>",
                                                                *GEMMA3_TOKENS.values()],
                                  "bos_token": "<bos>", "eos_token": "<end_of_turn>"})
    tokenizer._set_model_specific_special_tokens(GEMMA3_TOKENS)  # saved as the Hub's tokenizer_config.json does
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in GEMMA3_TOKENS.items()}
    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                            sliding_window=512, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    tower = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                               image_size=LLAVA_SIZE, patch_size=14, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=tower, mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
                          boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                          image_token_index=ids["image_token"])
    image_processor = Gemma3ImageProcessorPil(size={"height": LLAVA_SIZE, "width": LLAVA_SIZE})
    return config, Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                   image_seq_length=GEMMA3_IMAGE_TOKENS, chat_template=tokenizer.chat_template)


BUILDERS = {"qwen2_5_vl": qwen2_5_vl, "qwen2_vl": qwen2_vl, "qwen3_vl": qwen3_vl, "qwen3_vl_moe": qwen3_vl_moe,
            "llava": llava,
            "llava_next": llava_next, "idefics3": idefics3, "gemma3": gemma3}
# TRL's copies of each family's own template (Qwen2-VL's is Qwen2.5-VL's: the same text)
TEMPLATES = {"qwen2_5_vl": "trl:qwen2_5_vl", "qwen2_vl": "trl:qwen2_5_vl", "qwen3_vl": "trl:qwen3_vl",
             "qwen3_vl_moe": "trl:qwen3_vl",
             "llava": "trl:llava_next", "llava_next": "trl:llava_next", "idefics3": "trl:idefics3",
             "gemma3": "trl:gemma3"}


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
