"""The two lists transformers attaches to a loaded model, as hftrain leaves them
(hftrain/modeling/wrap_classes_and_renamings.py): FSDP2's wrap classes only those the model holds, and the renamings
a save reverts only those its load applied. The 2-rank launches of tests/test_vision_exact.py prove both end to end
(FSDP2 and ZeRO-3 against one rank); these show each in process, per family."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from safetensors import safe_open
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import revert_weight_conversion
from transformers.integrations.deepspeed import _load_state_dict_into_zero3_model
from transformers.modeling_utils import LoadStateDictConfig

from hftrain.config import ModelSection
from hftrain.heads import Head
from hftrain.modeling import load_model
from hftrain.modeling.wrap_classes_and_renamings import keep_used_weight_conversions

from .test_vision import FAMILIES, vlm_dirs  # noqa: F401  (the session's tiny models)

WRAPPED = {"qwen2_5_vl": {"Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"},
           "qwen2_vl": {"Qwen2VLDecoderLayer", "Qwen2VLVisionBlock"},
           "qwen3_vl": {"Qwen3VLTextDecoderLayer", "Qwen3VLVisionBlock"},
           "qwen3_vl_moe": {"Qwen3VLMoeTextDecoderLayer", "Qwen3VLMoeVisionBlock"},
           "llava": {"LlamaDecoderLayer", "CLIPEncoderLayer", "CLIPVisionEmbeddings"},
           "llava_next": {"LlamaDecoderLayer", "CLIPEncoderLayer", "CLIPVisionEmbeddings"},
           "gemma3": {"Gemma3DecoderLayer", "SiglipEncoderLayer", "SiglipVisionEmbeddings"},
           "idefics3": {"LlamaDecoderLayer", "Idefics3VisionAttention"}}  # Idefics3's own _no_split_modules
# the families whose renamings include legacy ones their checkpoints do not use (a ZeRO-3 load keeps them all)
LEGACY_RENAMINGS = set(WRAPPED) - {"idefics3"}


def _loaded(folder):
    return load_model(ModelSection(name_or_path=folder, dtype="float32"), head=Head.IMAGE_TEXT_TO_TEXT)


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_wraps_the_layers_the_model_holds(vlm_dirs, family):  # noqa: F811
    """accelerate's FSDP2 policy from the model's _no_split_modules (no class named in the recipe): LLaVA's list
    named CLIPTextEmbeddings, which it lacks, and the policy raised; now it wraps each family's decoder layers and
    vision blocks."""
    model = _loaded(vlm_dirs[family])
    plugin = SimpleNamespace(auto_wrap_policy=transformer_auto_wrap_policy, transformer_cls_names_to_wrap=None)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    assert {type(m).__name__ for m in model.modules() if policy(m)} == WRAPPED[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_zero3_load_saves_under_the_checkpoints_names(vlm_dirs, family):  # noqa: F811
    """ZeRO-3's loader (run here on a loaded model: without ZeRO-3 enabled it renames the checkpoint's keys and loads
    nothing) leaves every renaming of the family on the model, used or not; the save then reverted the unused ones too
    (model.model.layers...). With only the used ones kept, the names a save writes are the checkpoint's."""
    folder = vlm_dirs[family]
    model = _loaded(folder)
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        checkpoint = {k: f.get_tensor(k) for k in f.keys()}
    _load_state_dict_into_zero3_model(model, dict(checkpoint),
                                      LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(model)))
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()  # Gemma 3: not saved
    saved = set(revert_weight_conversion(model, model.state_dict())) - tied
    if family in LEGACY_RENAMINGS:
        assert saved != set(checkpoint)  # what transformers' ZeRO-3 load alone leaves a save to write
    keep_used_weight_conversions(model)
    assert set(revert_weight_conversion(model, model.state_dict())) - tied == set(checkpoint)
