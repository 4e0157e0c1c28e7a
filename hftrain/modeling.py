"""Model and tokenizer loading (transformers Auto classes), LoRA through peft."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .config import ModelSection
from .distributed import print0
from .errors import ModelError
from .fileio import safetensors_problem
from .kernels import apply_liger, liger_problem, uses_liger
from .moe.upcycle import upcycle
from .quantization import (bitsandbytes_problem, bnb_config, checked_merged_model, keep_training_kernels, placement,
                           prepare_for_training, record_fingerprint)


def _path_problem(name_or_path: str, key: str) -> str | None:
    # A Hub id is "name" or "org/name"; anything else is a local path, and a missing one is a typo, not a download.
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not os.path.exists(os.path.expanduser(name_or_path)):
        return f"{key}: {name_or_path} does not exist (a local path; check the spelling or build it first)"
    return None


def _pickle_only_problem(path: str) -> str | None:
    """A local folder with pickle weights only: say why it is refused and how to convert it."""
    if not os.path.isdir(path):
        return None
    names = os.listdir(path)
    pickles = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth")))
    if pickles and not any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json") for n in names):
        return (f"model.name_or_path: {path} holds pickle weights only ({', '.join(pickles[:3])}); hftrain loads "
                "safetensors only, because unpickling a file can run code. If you trust the file, convert it once: "
                "AutoModelForCausalLM.from_pretrained(path).save_pretrained(path) (writes model.safetensors)")
    return None


def _folder_problem(path: str, key: str) -> str | None:
    """A local model folder whose config.json does not parse, or whose safetensors files are not whole (a copy or a
    download cut short): named before anything is loaded, rather than as a loader's traceback minutes later."""
    folder = os.path.expanduser(path)
    if not os.path.isdir(folder):
        return None
    config = os.path.join(folder, "config.json")
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as fh:
                if not isinstance(json.load(fh), dict):
                    raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            return f"{key}: {config} is not a readable JSON object ({e}); restore the folder or save it again"
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            problem = safetensors_problem(os.path.join(folder, name))
            if problem:
                return f"{key}: {problem}; restore the folder or save it again"
    return None


TRL_TEMPLATE = "trl:"  # data.chat_template: trl:NAME is TRL's shipped chat_templates/NAME.jinja


def chat_template_file(chat_template: str | None) -> str | None:
    """The .jinja file data.chat_template names: a path, or trl:NAME for a template TRL ships (its training
    variants, with {% generation %} markers, are trl:NAME_training); None for template text."""
    if chat_template and chat_template.startswith(TRL_TEMPLATE):
        spec = importlib.util.find_spec("trl")
        folder = os.path.join(spec.submodule_search_locations[0], "chat_templates") if spec else ""
        return os.path.join(folder, chat_template[len(TRL_TEMPLATE):] + ".jinja")
    return chat_template if chat_template and chat_template.endswith(".jinja") else None


def _chat_template_problem(chat_template: str | None, key: str = "data.chat_template") -> str | None:
    path = chat_template_file(chat_template)
    if path and not os.path.isfile(path):
        if chat_template.startswith(TRL_TEMPLATE):
            folder = os.path.dirname(path)
            names = sorted(n[:-6] for n in os.listdir(folder) if n.endswith(".jinja")) if os.path.isdir(folder) else []
            return (f"{key}: TRL ships no template {chat_template!r} (trl:NAME, NAME one of: "
                    f"{', '.join(names) or 'none: is trl installed?'})")
        return (f"{key}: {chat_template} does not exist; give an existing .jinja file or the template "
                "itself as a string")
    return None


def chat_template_text(chat_template: str, key: str = "data.chat_template") -> str:
    """The template a .jinja path or trl:NAME names, or `chat_template` itself (template text)."""
    _raise_if(_chat_template_problem(chat_template, key))
    path = chat_template_file(chat_template)
    if not path:
        return chat_template
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def path_problems(cfg: ModelSection, chat_template: str | None = None) -> list[tuple[str, str]]:
    """(key, message) for model, tokenizer and chat template paths that cannot be loaded: checked before anything
    is loaded (launch.preflight) and again by the loaders."""
    checks = [("model.name_or_path", _path_problem(cfg.name_or_path, "model.name_or_path")),
              ("model.name_or_path", _pickle_only_problem(cfg.name_or_path)),
              ("model.name_or_path", _folder_problem(cfg.name_or_path, "model.name_or_path")),
              ("data.chat_template", _chat_template_problem(chat_template))]
    if cfg.tokenizer_name_or_path:
        checks.append(("model.tokenizer_name_or_path",
                       _path_problem(cfg.tokenizer_name_or_path, "model.tokenizer_name_or_path")))
    return [(key, msg) for key, msg in checks if msg]


def remote_code(name_or_path: str) -> list[str]:
    """What trust_remote_code will run from a local folder: its auto_map classes (config.json,
    tokenizer_config.json) and its .py files with the start of their sha256 (to compare with what you reviewed)."""
    folder = os.path.expanduser(name_or_path)
    if not os.path.isdir(folder):
        return []
    found = []
    for name in ("config.json", "tokenizer_config.json"):
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as fh:
                auto_map = json.load(fh).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue
        for cls, ref in sorted(auto_map.items()):
            found.append(f"{name} auto_map {cls} -> {ref if isinstance(ref, str) else ', '.join(map(str, ref))}")
    for f in sorted(os.listdir(folder)):
        if f.endswith(".py"):
            with open(os.path.join(folder, f), "rb") as fh:
                found.append(f"{f} (sha256 {hashlib.sha256(fh.read()).hexdigest()[:12]})")
    return found


_warned: set[str] = set()


def warn_remote_code(cfg: ModelSection, name: str) -> None:
    """model.trust_remote_code runs Python shipped with the checkpoint: say what, once per folder or Hub id."""
    if not cfg.trust_remote_code or name in _warned:
        return
    _warned.add(name)
    code = remote_code(name)
    shown = "".join(f"\n  - {c}" for c in code) if code else (
        " (a Hub id: the code is downloaded with it; read it on the Hub at the revision you pin with model.revision)")
    print0(f"hftrain: warning: model.trust_remote_code is true: loading {name} runs the Python code shipped with it"
           f"{shown}", file=sys.stderr)


def _raise_if(problem: str | None) -> None:
    if problem:
        raise ModelError(problem)


def resolved_name_or_path(name_or_path: str) -> str:
    """A local folder as an absolute path, a Hub id as it is. The model is loaded from this: peft records it as the
    adapter's base_model_name_or_path (adapter_config.json), and a relative one would not load from elsewhere."""
    local = os.path.expanduser(name_or_path)
    return os.path.abspath(local) if os.path.isdir(local) else name_or_path


def local_config(cfg: ModelSection):
    """The model's config from local files only (a folder, or the Hub cache), or None when it cannot be read here:
    path_problems or the loader then says why. For checks that build the model on the meta device."""
    try:
        return AutoConfig.from_pretrained(cfg.name_or_path, revision=cfg.revision,
                                          trust_remote_code=cfg.trust_remote_code, local_files_only=True)
    except Exception:  # noqa: BLE001 - any reason: the checks that need it are skipped, the others report it
        return None


def load_tokenizer(cfg: ModelSection, chat_template: str | None = None):
    name = cfg.tokenizer_name_or_path or cfg.name_or_path
    _raise_if(_path_problem(name, "model.tokenizer_name_or_path" if cfg.tokenizer_name_or_path
                            else "model.name_or_path"))
    _raise_if(_chat_template_problem(chat_template))
    warn_remote_code(cfg, name)
    key = "model.tokenizer_name_or_path" if cfg.tokenizer_name_or_path else "model.name_or_path"
    try:
        tok = AutoTokenizer.from_pretrained(name, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError) as e:  # a folder with broken or missing tokenizer files
        raise ModelError(f"{key}: cannot load a tokenizer from {name} ({type(e).__name__}: {str(e)[:300]}); "
                         "check its tokenizer files (tokenizer.json, tokenizer_config.json) or save it again") from None
    if not getattr(tok, "is_fast", False):
        raise ModelError(f"model.tokenizer_name_or_path: {name} has no fast tokenizer; hftrain's loss masks "
                         "need offsets")
    if chat_template:
        tok.chat_template = chat_template_text(chat_template)
    if tok.pad_token is None:
        # Labels are padded with -100 and the attention mask hides padding, so reusing EOS for padding is safe.
        tok.pad_token = tok.eos_token
    return tok


def reads_packing_from_one_row(attn_implementation: str | None) -> bool:
    """Flash-attention kernels (flash_attention_2/3, kernels-community/flash-attn*) find packed sequences from
    position_ids only in a batch of one row (transformers' _is_packed_sequence); in several rows they would attend
    across the examples of a row."""
    return "flash" in (attn_implementation or "")


def join_packed_rows(model) -> None:
    """Hooks on `model`: a packed batch of several rows (hftrain's packing collator) goes through the model as one
    row (the rows end to end; each row's padding is a sequence of its own), its logits come back in rows. Exact:
    packed sequences never attend to each other."""
    shapes: list[torch.Size] = []

    def before(module, args, kwargs):
        ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
        if args or ids is None or pos is None or ids.shape[0] == 1 or kwargs.get("attention_mask") is not None:
            shapes.append(None)
            return None
        shapes.append(ids.shape)
        return args, {**kwargs, "input_ids": ids.reshape(1, -1), "position_ids": pos.reshape(1, -1)}

    def after(module, args, kwargs, output):
        shape = shapes.pop()
        if shape is not None and getattr(output, "logits", None) is not None:
            output.logits = output.logits.reshape(*shape, -1)
        return output

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)


def _from_pretrained(cfg: ModelSection, quantized: bool):
    """The base of `cfg` as transformers loads it (safetensors only: a pickle checkpoint could run code on load),
    quantised by bitsandbytes when asked (placed whole on this rank's device, as accelerate requires)."""
    _raise_if(_path_problem(cfg.name_or_path, "model.name_or_path"))
    _raise_if(_pickle_only_problem(cfg.name_or_path))
    _raise_if(_folder_problem(cfg.name_or_path, "model.name_or_path"))
    warn_remote_code(cfg, cfg.name_or_path)
    dtype = "auto" if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
    kwargs = {"dtype": dtype, "revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.experts_implementation:
        kwargs["experts_implementation"] = cfg.experts_implementation
    if quantized:
        _raise_if(bitsandbytes_problem())
        kwargs.update(quantization_config=bnb_config(cfg), **placement())
    try:
        model = AutoModelForCausalLM.from_pretrained(resolved_name_or_path(cfg.name_or_path), use_safetensors=True,
                                                     **kwargs)
    except (OSError, ValueError, KeyError) as e:  # a missing file, an unknown architecture, a broken header
        raise ModelError(f"model.name_or_path: cannot load {cfg.name_or_path} ({type(e).__name__}: {str(e)[:300]}); "
                         "check the folder (config.json and the weights) or save it again") from None
    return keep_training_kernels(model) if quantized else model


def load_model(cfg: ModelSection, packing: bool = False, moe=None, sequence_parallel: int = 1):
    """The model of `cfg`, quantised (QLoRA's base) or upcycled to MoE, with liger's kernels, with LoRA.
    `sequence_parallel` > 1: packed rows are split by sequence_parallel.DocumentAttention, never joined into one row
    (Ulysses checks the rows it registered)."""
    model = _from_pretrained(cfg, quantized=cfg.quantization is not None)
    if cfg.kernels == "liger":
        _raise_if(liger_problem(model.config.model_type))
    if uses_liger(cfg.kernels, model.config.model_type, quantized=cfg.quantization is not None):
        apply_liger(model)
    if cfg.quantization is not None:
        model = prepare_for_training(record_fingerprint(model))  # the packed base trained against, for the merge
    if moe is not None and moe.upcycle is not None:  # dense -> native MoE, equal outputs (hftrain.moe.upcycle)
        u = moe.upcycle
        model = upcycle(model, u.num_experts, u.top_k, u.layers, u.router_init_std)
    if packing:
        # transformers 5 builds the block-diagonal mask of packed rows from position_ids only when no KV cache is
        # passed, and with config.use_cache=True the forward creates one even in training: packed examples would
        # attend to each other. Training never needs the cache (generate() turns it back on for itself).
        model.config.use_cache = False
    if cfg.lora is not None:
        from peft import get_peft_model  # optional dependency, heavy to import: LoRA runs only

        model = get_peft_model(model, lora_config(cfg))
        if cfg.gradient_checkpointing:
            model.enable_input_require_grads()
    if packing and sequence_parallel == 1 and reads_packing_from_one_row(model.config._attn_implementation):
        join_packed_rows(model)  # on the outermost model: peft calls the base model's forward() without hooks
    return model


def saved_shapes(model) -> dict[str, tuple[int, ...]]:
    """name -> shape of `model`'s weights as save_pretrained writes them (works on the meta device): transformers 5
    holds some families' experts fused (Mixtral's, Qwen-MoE's) and saves them per expert, in the Hub's layout."""
    from transformers.core_model_loading import revert_weight_conversion  # the one place saving's names come from

    return {k: tuple(v.shape) for k, v in revert_weight_conversion(model, dict(model.state_dict())).items()}


def lora_config(cfg: ModelSection):
    """peft's LoraConfig of model.lora."""
    from peft import LoraConfig  # optional dependency, heavy to import: LoRA runs only

    return LoraConfig(task_type="CAUSAL_LM", r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=cfg.lora.target_modules, modules_to_save=cfg.lora.modules_to_save,
                      target_parameters=cfg.lora.target_parameters)


def _whole(model, output_dir: str, cfg: ModelSection, sharded: bool):
    """The QLoRA model to merge, whole on this process: `model` itself, or where FSDP or ZeRO-3 shards it (each rank
    holds a piece of every weight) the base quantised again from its files with the adapter output_dir holds, as
    saved; the merge checks that base against the one the run recorded (quantization.checked_merged_model)."""
    if not sharded:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(_from_pretrained(cfg, quantized=True), output_dir)


@contextlib.contextmanager
def loading_outside_zero3(args):
    """Models loaded in this block load whole on this process: a ZeRO-3 run's config (`args`, its TrainingArguments)
    makes from_pretrained partition them with zero.Init, a collective that only the main process would reach (the
    merge: a hang); it is registered again after."""
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if getattr(args, "hf_deepspeed_config", None) is not None:
            set_hf_deepspeed_config(args.hf_deepspeed_config)


def save_merged(model, tokenizer, output_dir: str, cfg: ModelSection, sharded: bool = False) -> str:
    """base + LoRA merged into a plain model in output_dir/merged (safetensors). A quantised base is dequantised
    first, into a full-precision copy of the base in model.dtype (quantization.merge says why), once shown to be the
    packed base the run trained against (its fingerprint, written to output_dir); `sharded`: the run's
    strategy shards the weights (FSDP, ZeRO-3)."""
    if cfg.quantization is not None:
        merged = checked_merged_model(model, _whole(model, output_dir, cfg, sharded),
                                      _from_pretrained(cfg, quantized=False), output_dir)
    else:
        merged = model.merge_and_unload()
    path = os.path.join(output_dir, "merged")
    merged.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
