"""The merged model of a QLoRA run: the adapter merged into the dequantised base.

peft's merge_and_unload on a quantised base adds the adapter's update and quantises the sum again (a 4-bit model
whose weights moved by up to a quantisation step), and merging into the original full-precision weights would give
another model than the one trained (the adapter learnt against the quantised weights). So the base's linear weights
are dequantised from the trained model's own quantised weights (transformers' dequantize_bnb_weight, the same
function as PreTrainedModel.dequantize), written into a full-precision copy of the base, and the adapter is merged
into that by peft.

The base merged into must be the packed base the adapter was trained against: where the run's weights are sharded
the base is quantised again from its files, so the merge checks it against the fingerprint the run recorded as it
loaded the base (quantization.fingerprint), and refuses another one, naming the layers.
"""

from __future__ import annotations

import torch

from ..errors import ModelError
from .fingerprint import (FILE, base_fingerprint, read_fingerprint, recorded_fingerprint, refuse_another_base,
                          weight_name, write_fingerprint)

WHOLE = "the trained model's packed weights at the merge"
REQUANTISED = "the base quantised again from model.name_or_path for the merge (the run's weights are sharded)"


def dequantized_linear_weights(trained) -> dict[str, torch.Tensor]:
    """{name in the base model's state dict: the dequantised weight, on the CPU} of every bitsandbytes layer of
    `trained` (a peft model over a quantised base)."""
    import bitsandbytes as bnb  # optional dependency: model.quantization only
    from transformers.integrations.bitsandbytes import dequantize_bnb_weight

    out = {}
    for name, module in trained.get_base_model().named_modules():
        if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            state = module.state if isinstance(module, bnb.nn.Linear8bitLt) else None
            out[weight_name(name)] = dequantize_bnb_weight(module.weight, state).detach().to("cpu")
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


def checked_merged_model(trained, to_merge, full_base, output_dir: str):
    """merged_model(to_merge, full_base), once the packed base of `to_merge` (`trained` itself where the run's model
    is whole here, else the base quantised again with the adapter output_dir holds) is shown to be the one `trained`
    was trained against: the fingerprint the run recorded at its load (written to output_dir beside the adapter), or
    one already written there by an earlier merge. Refused (ModelError, naming the layers) where it differs."""
    recorded = recorded_fingerprint(trained) or read_fingerprint(output_dir)
    if recorded is None and to_merge is not trained:
        raise ModelError(f"model.lora.merge: no record of the packed base the adapter was trained against (the run "
                         f"writes {FILE} beside the adapter): the base quantised again cannot be checked")
    if recorded is None:
        recorded = base_fingerprint(trained)  # a model loaded elsewhere, whole here: its weights as they are now
    write_fingerprint(output_dir, recorded)
    refuse_another_base(recorded, base_fingerprint(to_merge), WHOLE if to_merge is trained else REQUANTISED)
    return merged_model(to_merge, full_base)
