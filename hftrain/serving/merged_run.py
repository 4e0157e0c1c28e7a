"""The full weights of a finished run, for a format that takes no adapter (GGUF): a full run's own folder; an adapter
run's merged/ (written by the run with hub.merge_lora), or merged now as the run would have merged it
(modeling.save_merged: a QLoRA base dequantised, once shown to be the base the adapter was trained against)."""

from __future__ import annotations

import os

from ..config import ModelSection
from ..errors import ModelError
from ..modeling import save_merged
from ..modeling.model import load_base

ADAPTER_CONFIG = "adapter_config.json"
MERGED = "merged"


def is_adapter_run(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, ADAPTER_CONFIG))


def merged_folder(run: str, cfg: ModelSection | None) -> str:
    """The folder of full weights for `run` (`cfg`: the run's model section, for an adapter run merged now)."""
    if not is_adapter_run(run):
        return run
    merged = os.path.join(run, MERGED)
    if os.path.isfile(os.path.join(merged, "config.json")):
        return merged
    if cfg is None:
        raise ModelError(f"{run}: a LoRA adapter without its run's recipe.yaml (the base and the quantisation it was "
                         "trained on): export the run's folder, or merge it yourself (peft's merge_and_unload)")
    from peft import PeftModel  # optional and heavy: only an adapter run merged here needs it
    from transformers import AutoTokenizer

    model = PeftModel.from_pretrained(load_base(cfg, quantized=cfg.quantization is not None), run)
    path = save_merged(model, AutoTokenizer.from_pretrained(run), run, cfg)
    print(f"hftrain: {run}: base + adapter merged into {path}")
    return path
