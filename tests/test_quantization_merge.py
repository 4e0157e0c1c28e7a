"""The merge of a QLoRA run is made into the packed base the adapter was trained against, or refused (issue 54).

A sharded run's merge (FSDP2, ZeRO-3) quantises the base again from its files; the run records the fingerprint of
the base it loaded (hftrain.quantization.fingerprint) and the merge checks the base it merges into against it.
In process here (save_merged's sharded path on one process); the 2-rank launches: tests/test_quantization_runs.py.
"""

import dataclasses
import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from hftrain.config import LoraSection, ModelSection, QuantizationSection
from hftrain.errors import ModelError
from hftrain.modeling import load_model, save_merged

bnb = pytest.importorskip("bitsandbytes")

from hftrain.quantization import FINGERPRINT_FILE, base_fingerprint  # noqa: E402  (needs bitsandbytes)
from tests.exactness import within  # noqa: E402

LAYER = "model.layers.0.self_attn.q_proj.weight"


def _qlora(model_dir):
    cfg = ModelSection(name_or_path=model_dir, dtype="float32", quantization=QuantizationSection(bits=4, type="nf4"),
                       lora=LoraSection(r=4, alpha=8, dropout=0.0, target_modules="all-linear"))
    model = load_model(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # LoRA's B starts at zero: random, so the adapter matters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return cfg, model


def _cast_copy(model_dir, dest):
    """The base with its weights rounded to bfloat16 and stored as float32 again: same names, shapes and dtype."""
    shutil.copytree(model_dir, dest)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(torch.float32)
    model.save_pretrained(dest, safe_serialization=True)


def test_a_sharded_runs_merge_checks_the_base_it_quantised_again(tiny_model_dir, tokenizer, tmp_path):
    """The merged model of the sharded path (the base quantised again from its files, the adapter as saved) gives the
    trained model's logits, with the run's fingerprint written beside the adapter; a base that differs (quantised
    from a copy cast through bfloat16: every layer's packed bytes differ) is refused, naming a layer, and no merged
    model is written."""
    base_dir = str(tmp_path / "base")
    shutil.copytree(tiny_model_dir, base_dir)
    cfg, qlora = _qlora(base_dir)
    out = tmp_path / "out"
    qlora.save_pretrained(str(out))
    ids = torch.randint(0, qlora.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = qlora(input_ids=ids).logits
    merged = AutoModelForCausalLM.from_pretrained(save_merged(qlora, tokenizer, str(out), cfg, sharded=True),
                                                  dtype=torch.float32)
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    within("quantization.merged_vs_qlora.logits", got, want, label="sharded merge")
    recorded = json.load(open(out / FINGERPRINT_FILE))["layers"]
    assert recorded == base_fingerprint(qlora) and LAYER in recorded and len(recorded) == 14
    assert {layer["quantized_from"] for layer in recorded.values()} == {"float32"}

    shutil.rmtree(out / "merged")
    shutil.rmtree(base_dir)
    _cast_copy(tiny_model_dir, base_dir)  # the files changed under the run: the merge would quantise another base
    with pytest.raises(ModelError, match=r"model.lora.merge: the base quantised again from model.name_or_path .* "
                                         r"is not the packed base the adapter was trained against: 14 layer\(s\) "
                                         r"differ, first model.layers.0.mlp.down_proj.weight"):
        save_merged(qlora, tokenizer, str(out), cfg, sharded=True)
    assert not os.path.exists(out / "merged")


def test_a_whole_runs_merge_refuses_packed_weights_changed_since_the_load(tiny_model_dir, tokenizer, tmp_path):
    """DDP's merge dequantises the trained model's own packed weights: where they are no longer those loaded (as
    bitsandbytes' in-place repacking for its CPU inference kernel once did, quantization.keep_training_kernels) the
    merge is refused, naming the layer."""
    cfg, qlora = _qlora(tiny_model_dir)
    layer = qlora.get_base_model().get_submodule(LAYER.removesuffix(".weight"))
    with torch.no_grad():
        layer.base_layer.weight.data.view(torch.uint8)[0] ^= 0x11  # two nibbles: two weights on another code
    with pytest.raises(ModelError, match=rf"the trained model's packed weights at the merge is not the packed base "
                                         rf"the adapter was trained against: 1 layer\(s\) differ, first {LAYER}"):
        save_merged(qlora, tokenizer, str(tmp_path), cfg)
    assert not os.path.exists(tmp_path / "merged")


def test_under_zero3_the_run_quantises_the_base_as_the_merge_does(tiny_model_dir):
    """ZeRO-3's zero.Init would partition (and cast) the weights as they load, but transformers never enters it for a
    quantised model (modeling_utils.get_init_context: meta device instead): the run's base is quantised whole from
    the file's weights cast to model.dtype, as the merge's (loading_outside_zero3) is. Here a float32 file under
    model.dtype bfloat16 with ZeRO-3 registered: the packed base the run records is byte-equal to the merge's, and
    both differ from the base quantised from the file's own float32 (the control: the cast does change them)."""
    from types import SimpleNamespace

    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from hftrain.modeling import loading_outside_zero3
    from hftrain.modeling.model import load_base

    cfg = ModelSection(name_or_path=tiny_model_dir, dtype="bfloat16", lora=LoraSection(r=4),
                       quantization=QuantizationSection(bits=4, storage_dtype="bfloat16"))
    zero3 = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                               "train_micro_batch_size_per_gpu": 1})
    try:
        assert is_deepspeed_zero3_enabled()
        recorded = base_fingerprint(load_model(cfg))
        with loading_outside_zero3(SimpleNamespace(hf_deepspeed_config=zero3)):
            assert not is_deepspeed_zero3_enabled()
            merged_into = base_fingerprint(load_base(cfg, quantized=True))
        assert is_deepspeed_zero3_enabled()
    finally:
        unset_hf_deepspeed_config()
    assert recorded == merged_into and len(recorded) == 14
    assert {layer["quantized_from"] for layer in recorded.values()} == {"bfloat16"}
    from_file_dtype = base_fingerprint(load_base(dataclasses.replace(cfg, dtype="float32"), quantized=True))
    assert all(from_file_dtype[k]["sha256"] != recorded[k]["sha256"] for k in recorded)
