"""The merged model of a QLoRA run: the adapter merged into the dequantised base.

peft's merge_and_unload on a quantised base adds the adapter's update and quantises the sum again (a 4-bit model
whose weights moved by up to a quantisation step), and merging into the original full-precision weights would give
another model than the one trained (the adapter learnt against the quantised weights). So the base's linear weights
are dequantised from the trained model's own quantised weights (transformers' dequantize_bnb_weight, the same
function as PreTrainedModel.dequantize), written into a full-precision copy of the base, and the adapter is merged
into that by peft.
"""

from __future__ import annotations

import torch

BASE_LAYER = ".base_layer"  # the name peft gives the layer a LoRA layer wraps


def dequantized_linear_weights(trained) -> dict[str, torch.Tensor]:
    """{name in the base model's state dict: the dequantised weight, on the CPU} of every bitsandbytes layer of
    `trained` (a peft model over a quantised base)."""
    import bitsandbytes as bnb  # optional dependency: model.quantization only
    from transformers.integrations.bitsandbytes import dequantize_bnb_weight

    out = {}
    for name, module in trained.get_base_model().named_modules():
        if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            state = module.state if isinstance(module, bnb.nn.Linear8bitLt) else None
            key = name[: -len(BASE_LAYER)] if name.endswith(BASE_LAYER) else name
            out[f"{key}.weight"] = dequantize_bnb_weight(module.weight, state).detach().to("cpu")
    return out


def merged_model(trained, full_base):
    """`trained`'s adapter merged into `full_base` (the same model loaded in full precision) once its linear weights
    are those `trained` computed with: a plain transformers model."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    weights = dequantized_linear_weights(trained)
    params = dict(full_base.named_parameters())
    unknown = sorted(set(weights) - set(params))
    if unknown:  # a layout this merge does not know: refuse rather than save a half-merged model
        raise ValueError(f"cannot place the dequantised weights {unknown[:3]} in the full-precision base")
    with torch.no_grad():
        for key, w in weights.items():
            params[key].copy_(w.to(params[key].dtype))
    name = trained.active_adapter
    peft_model = get_peft_model(full_base, trained.peft_config[name])
    set_peft_model_state_dict(peft_model, get_peft_model_state_dict(trained, adapter_name=name))
    return peft_model.merge_and_unload()
