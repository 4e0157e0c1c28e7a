"""The fingerprint of a quantised base: which packed weights the adapter was trained against, checked at the merge.

The merge of a sharded run (FSDP2, ZeRO-3: no process holds the whole trained base) quantises the base again from
its files, trusting bitsandbytes to give the packed weights the run trained against. The run records, as it loads
the base, a sha256 per bitsandbytes layer of everything its weight is decoded from (the packed bytes, the absmax,
the code, the nested constants, the shape, the dtype it was quantised from); the merge compares the base it merges
into with that record and refuses to merge into another one, naming the layers that differ. The record is written
beside the adapter (FILE), so that a merge made later can be checked against it too.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from ..distributed import is_main_process
from ..errors import ModelError
from ..fileio import atomic_write

FILE = "quantized_base.json"  # beside the adapter: {"layers": {weight name: {"sha256", "quantized_from"}}}
RECORDED = "hftrain_quantized_base"  # the attribute of the loaded base model that holds its fingerprint
BASE_LAYER = ".base_layer"  # the name peft gives the layer a LoRA layer wraps


def weight_name(module_name: str) -> str:
    """The base model's state-dict name of a quantised layer's weight (peft's wrapper taken off)."""
    key = module_name[: -len(BASE_LAYER)] if module_name.endswith(BASE_LAYER) else module_name
    return f"{key}.weight"


def _hash_tensor(digest, tensor: torch.Tensor) -> None:
    """The tensor's bytes, whatever dtype holds them (model.quantization.storage_dtype only changes the view)."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    digest.update(f"{len(data)}:".encode())
    digest.update(data)


def _hash_items(items: dict) -> str:
    digest = hashlib.sha256()
    for key in sorted(items):
        digest.update(key.encode())
        value = items[key]
        if isinstance(value, torch.Tensor):
            _hash_tensor(digest, value)
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def layer_fingerprint(module) -> dict[str, str]:
    """{"sha256", "quantized_from"} of one bitsandbytes layer (4-bit: Linear4bit, 8-bit: Linear8bitLt)."""
    weight = module.weight
    state = getattr(weight, "quant_state", None)
    if state is not None:  # 4-bit: the packed bytes and bitsandbytes' own list of what decodes them
        items = {**state.as_dict(packed=False), "packed": weight.data}
        return {"sha256": _hash_items(items), "quantized_from": str(state.dtype).removeprefix("torch.")}
    scales = weight.SCB if getattr(weight, "SCB", None) is not None else module.state.SCB  # 8-bit: row scales
    return {"sha256": _hash_items({"int8": weight.data, "scales": scales}), "quantized_from": "int8 rows"}


def base_fingerprint(model) -> dict[str, dict[str, str]]:
    """{weight name: layer_fingerprint} of every bitsandbytes layer of `model` (a quantised base, or a peft model
    over one), whole on this process."""
    import bitsandbytes as bnb  # optional dependency: model.quantization only

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {weight_name(name): layer_fingerprint(module) for name, module in base.named_modules()
            if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}


def record_fingerprint(model):
    """`model` (a quantised base, just loaded: whole on this process under every strategy) with its fingerprint
    kept on it, as the base the run trains against: on the main process, the one that merges."""
    if is_main_process():
        setattr(model, RECORDED, base_fingerprint(model))
    return model


def recorded_fingerprint(trained) -> dict[str, dict[str, str]] | None:
    """The fingerprint record_fingerprint kept on `trained`'s base (a peft model), None where it has none."""
    base = trained.get_base_model() if hasattr(trained, "get_base_model") else trained
    return getattr(base, RECORDED, None)


def write_fingerprint(output_dir: str, fingerprint: dict[str, dict[str, str]]) -> str:
    path = os.path.join(output_dir, FILE)
    atomic_write(path, json.dumps({"layers": fingerprint}, indent=1, sort_keys=True) + "\n")
    return path


def read_fingerprint(output_dir: str) -> dict[str, dict[str, str]] | None:
    path = os.path.join(output_dir, FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)["layers"]


def differing_layers(trained: dict, merged_into: dict) -> list[str]:
    """The weight names whose packed weights differ between two fingerprints (or that one of them lacks)."""
    return sorted(name for name in set(trained) | set(merged_into)
                  if trained.get(name, {}).get("sha256") != merged_into.get(name, {}).get("sha256"))


def refuse_another_base(trained: dict, merged_into: dict, where: str) -> None:
    """Raise ModelError, naming the layers, where the base the merge is about to merge into (`merged_into`) is not
    the packed base the adapter was trained against (`trained`)."""
    differ = differing_layers(trained, merged_into)
    if not differ:
        return
    first = differ[0]
    was, now = (fp.get(first, {}).get("quantized_from", "absent") for fp in (trained, merged_into))
    raise ModelError(
        f"model.lora.merge: {where} is not the packed base the adapter was trained against: {len(differ)} layer(s) "
        f"differ, first {first} (quantised from {now} weights here, from {was} in the run). No merged model was "
        f"written; the adapter is saved. Merge with the base files the run loaded, on the same bitsandbytes and "
        f"device kind (docs/qlora.md, 'The merge of a sharded run')")
