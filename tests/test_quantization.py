"""QLoRA (issue 39): a base quantised by bitsandbytes, trained through a LoRA adapter.

Exact against its definition: with fp32 compute, the 4-bit model's loss and adapter gradients are those of the same
LoRA on the dequantised base (transformers' own PreTrainedModel.dequantize, not hftrain's code); the merged model
loads with from_pretrained and gives the QLoRA model's logits; the recipe's rules refuse what cannot run; the memory
plan counts a 4-bit base as measured. Runs across ranks: tests/test_quantization_runs.py.
"""

import dataclasses

import pytest
import torch
import yaml

from hftrain.config import LoraSection, ModelSection, QuantizationSection, RecipeError
from hftrain.methods import load_recipe
from hftrain.launch import plan as memory_plan
from hftrain.launch.preflight import check_recipe
from hftrain.modeling import load_model, save_merged
from tests.exactness import beyond, within

bnb = pytest.importorskip("bitsandbytes")

LORA = LoraSection(r=4, alpha=8, dropout=0.0, target_modules="all-linear")


def section(model_dir, **quantization) -> ModelSection:
    return ModelSection(name_or_path=model_dir, dtype="float32", lora=LORA,
                        quantization=QuantizationSection(**quantization))


def perturbed(model, seed=0):
    """LoRA's B starts at zero (the adapter is then a no-op and A gets no gradient): random B, so both matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def lora_on_dequantised_base(qlora, cfg: ModelSection):
    """The definition: the same adapter on the base's dequantised weights, in full precision, by transformers and
    peft alone."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from hftrain.quantization import bnb_config

    base = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, quantization_config=bnb_config(cfg),
                                                dtype=torch.float32, device_map={"": "cpu"}).dequantize(torch.float32)
    ref = get_peft_model(base, qlora.peft_config["default"])
    set_peft_model_state_dict(ref, get_peft_model_state_dict(qlora))
    return ref


def loss_and_grads(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("quant", [{"type": "nf4"}, {"type": "fp4"}, {"type": "nf4", "double_quant": False}],
                         ids=["nf4", "fp4", "nf4-single-quant"])
def test_qlora_loss_and_adapter_gradients_are_lora_on_the_dequantised_base(tiny_model_dir, quant):
    cfg = section(tiny_model_dir, bits=4, **quant)
    qlora = perturbed(load_model(cfg))
    layer = qlora.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(layer, bnb.nn.Linear4bit) and layer.weight.dtype == torch.uint8
    assert layer.weight.quant_state.quant_type == quant["type"]
    ref = lora_on_dequantised_base(qlora, cfg)
    ids = torch.randint(0, qlora.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(qlora, ids)
    ref_loss, ref_grads = loss_and_grads(ref, ids)
    assert len(grads) == len(ref_grads) == 4 * 7 and set(grads) == set(ref_grads)  # A and B of 7 linears x 2 layers
    within("quantization.qlora_vs_dequantised_lora.loss", loss, ref_loss, label=quant["type"])
    within("quantization.qlora_vs_dequantised_lora.grads", grads, ref_grads, label=quant["type"])
    for name, g in grads.items():
        assert g.abs().max() > 0, name
    # Negative control: LoRA on the original full-precision weights is another model, outside the tolerance by more
    # than 10x (measured 3.7e-4 to over 1e-3 on this tiny model's loss, depending on the 4-bit type).
    full = perturbed(load_model(dataclasses.replace(cfg, quantization=None)))
    beyond("quantization.qlora_vs_dequantised_lora.loss", loss_and_grads(full, ids)[0], loss, label=quant["type"])


def test_an_eval_forward_leaves_the_4bit_layers_training_kernel(tiny_model_dir):
    """An eval or a GRPO generation (eval mode, no gradients) changes nothing in how the layers train next: the same
    loss and adapter gradients after as before. Without quantization.keep_training_kernels, bitsandbytes on a CPU with
    AVX512-BF16 repacks the weights for its inference kernel there (which drops the gradient through the layer, and
    crashes on this tiny model's widths)."""
    qlora = perturbed(load_model(section(tiny_model_dir, bits=4, type="nf4")))
    layers = [m for m in qlora.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 2 * 7 and not any(m.support_avx512bf16_for_cpu for m in layers)
    ids = torch.randint(0, qlora.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(qlora, ids)
    qlora.zero_grad(set_to_none=True)
    qlora.eval()
    with torch.no_grad():
        qlora(input_ids=ids)
    qlora.train()
    loss_after, grads_after = loss_and_grads(qlora, ids)
    assert loss_after == loss
    for name, g in grads.items():
        assert torch.equal(grads_after[name], g), name


def test_an_8bit_base_is_int8_and_within_llm_int8_tolerance_of_its_dequantised_base(tiny_model_dir):
    """LLM.int8 quantises the activations too (to int8, outliers aside): equal to its dequantised base only to that
    tolerance, stated here (a 0.5% relative loss difference), not to 1e-5."""
    cfg = section(tiny_model_dir, bits=8)
    qlora = perturbed(load_model(cfg))
    assert isinstance(qlora.get_base_model().model.layers[0].mlp.up_proj.base_layer, bnb.nn.Linear8bitLt)
    ids = torch.randint(0, qlora.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(qlora, ids)
    ref_loss, _ = loss_and_grads(lora_on_dequantised_base(qlora, cfg), ids)
    within("quantization.int8_vs_dequantised_lora.loss", loss, ref_loss)
    assert all(g.abs().max() > 0 for g in grads.values())


def test_an_8bit_bases_merged_model_is_the_adapter_on_its_dequantised_weights(tiny_model_dir, tokenizer, tmp_path):
    """LLM.int8 quantises the activations too, so the merged model cannot give the 8-bit model's logits exactly; it
    gives those of its definition: the adapter on the base's dequantised 8-bit weights (transformers' dequantize)."""
    from transformers import AutoModelForCausalLM

    cfg = section(tiny_model_dir, bits=8)
    qlora = perturbed(load_model(cfg))
    ids = torch.randint(0, qlora.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = lora_on_dequantised_base(qlora, cfg)(input_ids=ids).logits
        full = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)(input_ids=ids).logits
    merged = AutoModelForCausalLM.from_pretrained(save_merged(qlora, tokenizer, str(tmp_path), cfg),
                                                  dtype=torch.float32)
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    within("quantization.int8_merged_vs_dequantised_lora.logits", got, want)
    # negative control: the base's own weights (the adapter merged) differ
    beyond("quantization.int8_merged_vs_dequantised_lora.logits", full, got)


def test_the_merged_model_loads_and_gives_the_qlora_models_logits(tiny_model_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = section(tiny_model_dir, bits=4, type="nf4")
    qlora = perturbed(load_model(cfg))
    ids = torch.randint(0, qlora.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = qlora(input_ids=ids).logits
    path = save_merged(qlora, tokenizer, str(tmp_path), cfg)
    merged = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert not hasattr(merged.config, "quantization_config")
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    within("quantization.merged_vs_qlora.logits", got, want)
    # Negative control: peft's own merge into the 4-bit layers quantises the sum again.
    requantised = qlora.merge_and_unload()
    with torch.no_grad():
        beyond("quantization.merged_vs_qlora.logits", requantised(input_ids=ids).logits, want)


def _recipe(tmp_path, model_dir, **model) -> str:
    tree = {"model": {"name_or_path": model_dir, **model}, "data": {"sources": [{"path": "d.jsonl"}]},
            "training": {"output_dir": str(tmp_path / "o")}}
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(tree))
    return str(p)


def test_rules_refuse_what_a_quantised_base_cannot_do(tmp_path, tiny_model_dir):
    with pytest.raises(RecipeError) as e:
        eight_bits = {"bits": 8, "type": "nf4", "storage_dtype": "uint8"}
        load_recipe(_recipe(tmp_path, tiny_model_dir, quantization=eight_bits), ["strategy.name=zero2"])
    msg = str(e.value)
    assert "model.quantization: a quantised base cannot be trained itself" in msg and "add model.lora" in msg
    assert "model.quantization.type: applies to bits: 4 only" in msg
    assert "model.quantization.storage_dtype: applies to bits: 4 only" in msg
    assert "model.quantization: a quantised base trains under ddp, fsdp, zero3" in msg and "not 'zero2'" in msg
    with pytest.raises(RecipeError, match=r"model.quantization.bits: .*one of 4, 8"):
        load_recipe(_recipe(tmp_path, tiny_model_dir, quantization={"bits": 3}, lora={"r": 4}))
    recipe = load_recipe(_recipe(tmp_path, tiny_model_dir, quantization={"bits": 4}, lora={"r": 4}))
    assert recipe.model.quantization == QuantizationSection(bits=4)


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
@pytest.mark.parametrize("quantization, training, refused", [
    ({"bits": 4}, [], r"storage_dtype: is uint8 \(the default\): .* here float32 .*storage_dtype: float32"),
    ({"bits": 4, "storage_dtype": "float32"}, ["training.bf16=true"],
     "storage_dtype: is float32: .* here bfloat16 .*storage_dtype: bfloat16"),
    ({"bits": 8}, [], r"model.quantization.bits: \w+ shards a 4-bit base only"),
    ({"bits": 4, "storage_dtype": "float32"}, [], None),
    ({"bits": 4, "storage_dtype": "bfloat16"}, ["training.bf16=true"], None),
])
def test_sharding_strategies_take_a_4bit_base_stored_in_their_compute_dtype(tmp_path, tiny_model_dir, strategy,
                                                                            quantization, training, refused):
    """FSDP and ZeRO-3 shard a parameter as a tensor of its dtype and cast it to the dtype they compute in: the
    packed 4-bit weights must be stored in that dtype (on an H200, float32 storage under FSDP's bf16 trained without
    an error on gradients 2000x off)."""
    path = _recipe(tmp_path, tiny_model_dir, quantization=quantization, lora={"r": 4})
    if refused is None:
        assert load_recipe(path, [f"strategy.name={strategy}", *training]).model.quantization.bits == 4
        return
    with pytest.raises(RecipeError, match=refused):
        load_recipe(path, [f"strategy.name={strategy}", *training])


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_a_quantised_policy_trains_under_ddp_only(tmp_path, tiny_model_dir, strategy):
    """DPO, ORPO, KTO and GRPO on a quantised policy are tested under DDP (tests/test_quantization_runs.py): the
    sharded strategies are refused for them rather than run untried."""
    tree = {"model": {"name_or_path": tiny_model_dir, "quantization": {"bits": 4, "storage_dtype": "float32"},
                      "lora": {"r": 4}},
            "data": {"sources": [{"path": "d.jsonl"}]}, "preference": {"loss_type": "sigmoid"},
            "training": {"output_dir": str(tmp_path / "o")}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(tree))
    with pytest.raises(RecipeError, match=rf"strategy.name: a quantised policy .* under ddp only, not '{strategy}'"):
        load_recipe(str(tmp_path / "r.yaml"), [f"strategy.name={strategy}"])
    assert load_recipe(str(tmp_path / "r.yaml"), ["strategy.name=ddp"]).preference is not None


def test_check_refuses_a_quantised_base_where_bitsandbytes_is_missing(tmp_path, tiny_model_dir, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else
                        find_spec(name, *a))
    with pytest.raises(RecipeError, match=r"r.yaml: model.quantization needs bitsandbytes, which is not installed "
                                          r"here: `pip install bitsandbytes`"):
        check_recipe(_recipe(tmp_path, tiny_model_dir, quantization={"bits": 4}, lora={"r": 4}))


def test_the_memory_plan_counts_a_4bit_base_as_loaded(tiny_model_dir):
    """The plan's parameter, gradient and Adam bytes (ddp, one rank) against the tensors of the loaded model and of
    an optimizer after one step: within 15%."""
    cfg = section(tiny_model_dir, bits=4, type="nf4")
    model = perturbed(load_model(cfg))
    facts = memory_plan.model_facts(tiny_model_dir, lora_r=LORA.r, quantization=cfg.quantization)
    row = next(r for r in memory_plan.plan(facts, 1, 1, 1, 16, False, False) if r.strategy == "ddp")
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    opt.step()
    tensors = [*model.parameters(), *model.buffers()]
    quant_states = [s for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)
                    for s in _quant_state_tensors(m.weight.quant_state)]
    measured = (sum(t.numel() * t.element_size() for t in [*tensors, *quant_states])
                + sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
                + sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim()))
    assert row.gpu_model_states == pytest.approx(measured, rel=0.15)
    full = memory_plan.model_facts(tiny_model_dir, lora_r=LORA.r)
    assert facts.params == full.params and facts.trainable == full.trainable


def _quant_state_tensors(state):
    out = [state.absmax, state.code]
    if state.nested:
        out += [state.state2.absmax, state.state2.code]
    return out
