"""Can this recipe's model resume from that checkpoint? Checked before anything is loaded, by `hftrain check` and the
run alike (output_checks.resume_problems): a checkpoint of another model (other sizes, another architecture), of another
vocabulary, or with another LoRA adapter would otherwise fail minutes later inside the Trainer's load with a size
mismatch, or, worse, load and train on.

What the checkpoint holds is read from its safetensors headers (names and shapes, no tensor data) or, where its
weights are in another format (FSDP's sharded state, DeepSpeed's partitions), from its config.json; what the recipe
will build comes from transformers itself: the model built from its config on the meta device (no memory, no
weights), with peft's LoRA on top when model.lora is set, and the state dict that the Trainer would save of it.
"""

from __future__ import annotations

import copy
import json
import os
import warnings

import torch

from ..config import Recipe
from ..heads import Head
from ..methods import method_of
from ..checkpoints import CheckpointError, read_layout
from ..modeling import local_config, lora_config, saved_shapes
from ..quantization import described_quantization, quantization_of_section

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
ADAPTER_FILES = ("adapter_model.safetensors",)
# config.json entries that say nothing about the model's shape or maths.
BOOKKEEPING = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "architectures",
               "output_attentions", "output_hidden_states", "return_dict"}


def _headers(folder: str, names: tuple[str, ...]) -> dict[str, tuple[int, ...]] | None:
    """name -> shape from the safetensors files of `folder` (through an index when sharded); None without them."""
    from safetensors import safe_open

    files = []
    for name in names:
        path = os.path.join(folder, name)
        if name.endswith(".index.json") and os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                files += sorted(set(json.load(fh)["weight_map"].values()))
        elif os.path.isfile(path):
            files.append(name)
    if not files:
        return None
    shapes = {}
    for f in files:
        with safe_open(os.path.join(folder, f), framework="pt") as fh:
            shapes.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
    return shapes


def meta_model(config, trust_remote_code: bool, head: Head = Head.CAUSAL_LM, num_labels: int | None = None):
    """The model of `config` with `head` (its Auto class) on the meta device: no memory, no weights. `num_labels`: a
    classifier's classes, as the method loads it (methods.ModelSpec)."""
    if num_labels is not None:
        config = copy.deepcopy(config)
        config.num_labels = num_labels
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return head.auto_class.from_config(config, trust_remote_code=trust_remote_code)


def _expected(recipe: Recipe, config) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(name -> shape) of what a checkpoint of this recipe holds, and the names it may leave out (tied weights); the
    model built with the head of the policy the recipe's method trains."""
    m = recipe.model
    policy = method_of(recipe).policy(recipe)
    head = policy.head
    model = meta_model(config, m.trust_remote_code, head, policy.num_labels)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    if m.lora is None:  # named as save_pretrained writes them: MoE experts, for one, in their original format
        return saved_shapes(model), tied
    from peft import get_peft_model, get_peft_model_state_dict  # optional dependency: LoRA runs only

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, lora_config(m, head))
        return {k: tuple(v.shape) for k, v in get_peft_model_state_dict(peft_model).items()}, set()


def _config_dict(path: str) -> dict | None:
    """The checkpoint's config.json as transformers reads it (defaults filled in, as for the recipe's)."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True).to_dict()
    except Exception:  # noqa: BLE001 - a config transformers cannot read: the Trainer's load will say so
        return None


def _config_differences(theirs: dict | None, ours: dict) -> str:
    if theirs is None:
        return ""
    keys = sorted(k for k in set(theirs) | set(ours) if k not in BOOKKEEPING and theirs.get(k) != ours.get(k)
                  and not isinstance(theirs.get(k, ours.get(k)), dict))
    if not keys:
        return ""
    shown = ", ".join(f"{k} {theirs.get(k)!r} there, {ours.get(k)!r} here" for k in keys[:6])
    return f" (config.json: {shown}{' ...' if len(keys) > 6 else ''})"


def _shape_problems(path: str, theirs: dict, ours: dict, optional: set[str], what: str) -> list[str]:
    differ = [f"{k} {list(theirs[k])} there, {list(ours[k])} here" for k in sorted(set(theirs) & set(ours))
              if theirs[k] != ours[k]]
    extra = sorted(set(theirs) - set(ours))
    missing = sorted(set(ours) - set(theirs) - optional)
    if not (differ or extra or missing):
        return []
    parts = []
    if differ:
        parts.append(f"{len(differ)} tensor(s) of other shapes "
                     f"({'; '.join(differ[:3])}{' ...' if len(differ) > 3 else ''})")
    if extra:
        parts.append(f"{len(extra)} tensor(s) this run has no place for "
                     f"({', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''})")
    if missing:
        parts.append(f"{len(missing)} tensor(s) of this run missing "
                     f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''})")
    return [f"{path} holds {what} than this recipe builds: " + "; ".join(parts)]


def _adapter_settings(path: str, recipe: Recipe) -> list[str]:
    """LoRA settings that change no shape but the training (the scaling alpha / r)."""
    try:
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as fh:
            saved = json.load(fh)
    except (OSError, ValueError):
        return []
    lora = recipe.model.lora
    if isinstance(saved, dict) and saved.get("lora_alpha") not in (None, lora.alpha):
        return [f"{path}'s LoRA adapter has lora_alpha {saved['lora_alpha']}, "
                f"this recipe model.lora.alpha {lora.alpha}: "
                "its updates would be scaled differently from how they were trained"]
    return []


def _base_quantization(path: str, recipe: Recipe) -> list[str]:
    """The base an adapter was trained against, quantised as the checkpoint recorded (checkpoints.mixin), against
    the recipe's model.quantization (checkpoints written before the record: not compared)."""
    try:
        was = read_layout(path)
    except CheckpointError:
        return []  # verification reports an unreadable layout
    if not isinstance(was, dict) or "quantization" not in was:
        return []
    now = quantization_of_section(recipe.model.quantization)
    if was["quantization"] == now:
        return []
    return [f"{path}'s adapter was trained against a {described_quantization(was['quantization'])} base, and this "
            f"recipe loads it {described_quantization(now)} (model.quantization): the adapter would go on training "
            "against other weights; resume with the model.quantization that wrote it"]


def _vocab_problem(path: str, recipe: Recipe, load_tokenizer) -> str | None:
    """The checkpoint's tokenizer (the Trainer saves it beside the weights) against the recipe's: another vocabulary
    means every token id means something else."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")) and not os.path.isfile(
            os.path.join(path, "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(path).get_vocab()
        ours = load_tokenizer(recipe.model).get_vocab()
    except Exception:  # noqa: BLE001 - an unreadable tokenizer is for the loaders to report; nothing to compare
        return None
    if theirs == ours:
        return None
    by_id_theirs = {i: t for t, i in theirs.items()}
    by_id_ours = {i: t for t, i in ours.items()}
    differ = sorted(i for i in set(by_id_theirs) | set(by_id_ours) if by_id_theirs.get(i) != by_id_ours.get(i))
    first = differ[0]
    return (f"{path} was trained with another vocabulary: {len(theirs)} tokens there, {len(ours)} in this recipe's "
            f"tokenizer, {len(differ)} ids mean other tokens (id {first}: {by_id_theirs.get(first)!r} there, "
            f"{by_id_ours.get(first)!r} here)")


def compatibility_problems(path: str, recipe: Recipe, load_tokenizer=None) -> list[str]:
    """What differs between the checkpoint at `path` and the model this recipe builds: model config (architecture,
    sizes, through the tensors' names and shapes), LoRA adapter (rank, target modules, alpha), vocabulary. A recipe
    that upcycles to MoE (moe.upcycle) builds its model from another config: not compared."""
    from transformers import AutoConfig

    m = recipe.model
    if recipe.moe is not None and getattr(recipe.moe, "upcycle", None) is not None:
        return []
    config = local_config(m)
    if config is None:
        return []
    fix = ("Resume with the recipe that wrote it (model.name_or_path, model.lora), or start from scratch: set "
           "training.resume_from_checkpoint to false")
    has_adapter = any(os.path.isfile(os.path.join(path, f)) for f in (*ADAPTER_FILES, "adapter_config.json"))
    if has_adapter and m.lora is None:
        return [f"training.resume_from_checkpoint: {path} holds a LoRA adapter and this recipe trains every weight "
                f"(no model.lora). {fix}"]
    if m.lora is not None and not has_adapter and _headers(path, WEIGHT_FILES) is not None:
        return [f"training.resume_from_checkpoint: {path} holds a whole model and this recipe trains a LoRA adapter "
                f"(model.lora). {fix}"]
    ours_cfg = config.to_dict()
    theirs_cfg = _config_dict(path)
    try:
        expected, optional = _expected(recipe, config)
    except Exception:  # noqa: BLE001 - transformers cannot build this model on the meta device: nothing to compare
        return []
    problems = []
    saved = _headers(path, ADAPTER_FILES if m.lora is not None else WEIGHT_FILES)
    if saved is not None:
        what = "another LoRA adapter" if m.lora is not None else "another model"
        problems += [p + (_config_differences(theirs_cfg, ours_cfg) if m.lora is None else "")
                     for p in _shape_problems(path, saved, expected, optional, what)]
    elif theirs_cfg is not None and m.lora is None:  # weights in another format: their config says what they are
        try:
            theirs, _ = _expected(recipe, AutoConfig.from_pretrained(path, local_files_only=True))
        except Exception:  # noqa: BLE001 - a config transformers cannot read: the Trainer's load will say so
            theirs = None
        if theirs is not None:
            problems += [p + _config_differences(theirs_cfg, ours_cfg)
                         for p in _shape_problems(path, theirs, expected, optional, "another model")]
    if m.lora is not None and not problems:
        problems += _adapter_settings(path, recipe) + _base_quantization(path, recipe)
    if load_tokenizer is not None:
        vocab = _vocab_problem(path, recipe, load_tokenizer)
        if vocab:
            problems.append(vocab)
    return [f"training.resume_from_checkpoint: {p}. {fix}" for p in problems]
