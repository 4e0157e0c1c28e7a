"""What a folder must pass before it is uploaded: weights whose shapes match the config, a CPU load (by the Auto
class of the run's head, heads.Head, recorded in run_info.json) that gives finite logits and, for a head that
generates, generates, a tokenizer with its chat template and EOS, and for LoRA an adapter that is not zero and merges
exactly."""

from __future__ import annotations

import json
import os

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from ..config import ModelSection, QuantizationSection
from ..constants import PROBE_IDS, RECIPE_FILE, RUN_INFO_FILE
from ..fileio import read_json
from ..heads import Head
from ..modeling import saved_shapes
from ..quantization import bnb_config, keep_training_kernels


def head_of_run(output_dir: str) -> Head:
    """The head of the model a run trained, as its run_info.json records it (methods.Method.card); a causal LM for a
    run written before heads were recorded, or a folder without run_info.json. A run_info.json that is a symbolic
    link or no regular file is not read (not even for this: a link could point anywhere): the stage refuses it by
    name, so the head asked here is then never used."""
    path = os.path.join(output_dir, RUN_INFO_FILE)
    if os.path.islink(path) or (os.path.exists(path) and not os.path.isfile(path)):
        return Head.CAUSAL_LM
    return Head.recorded((read_json(path).get("method") or {}).get("head"))


def adapter_base_options(output_dir: str) -> dict:
    """from_pretrained's keywords that build the base of a run's LoRA adapter as the run built it: a classifier's
    classes (run_info.json: an outcome reward model's one score, where the base config says 2) and the base's
    quantisation (recipe.yaml's model.quantization, on the CPU: a QLoRA adapter was trained against the packed 4-bit
    weights, and its merged model is made from them dequantised). Files that are links or absent say nothing."""
    options = {}
    info_path, recipe_path = (os.path.join(output_dir, f) for f in (RUN_INFO_FILE, RECIPE_FILE))
    if os.path.isfile(info_path) and not os.path.islink(info_path):
        labels = (read_json(info_path).get("method") or {}).get("num_labels")
        if isinstance(labels, int):
            options["num_labels"] = labels
    if os.path.isfile(recipe_path) and not os.path.islink(recipe_path):
        with open(recipe_path, encoding="utf-8") as fh:
            model = (yaml.safe_load(fh) or {}).get("model") or {}
        if isinstance(model.get("quantization"), dict):
            section = ModelSection(name_or_path=model.get("name_or_path", ""), dtype=model.get("dtype", "auto"),
                                   quantization=QuantizationSection(**model["quantization"]))
            options.update(quantization_config=bnb_config(section), device_map={"": "cpu"})
    return options


def validate_folder(path: str, merged: str | None = None, trust_remote_code: bool = False,
                    head: Head = Head.CAUSAL_LM, base_options: dict | None = None) -> list[str]:
    """Everything wrong with the model folder `path` (a model with `head`) as a Hub upload; [] when it is fit to push.

    A full model: safetensors shards non-empty with the config's shapes, loads with from_pretrained on CPU and
    gives finite logits (and generates, with a generation_config EOS, where the head generates), tokenizer + chat
    template. A LoRA adapter (adapter_config.json): not all zero, loads onto its base (built with `base_options`:
    adapter_base_options), and when `merged` (a merged full model) is given, base + adapter logits == merged.
    """
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        problems = adapter_problems(path, merged, head, base_options)
    else:
        problems = _full_model_problems(path, trust_remote_code, head)
    tok_problems, _ = _tokenizer_problems(path)
    return problems + tok_problems


def _safetensors_shapes(path: str, files: list[str]) -> tuple[list[str], dict[str, tuple[int, ...]]]:
    problems, shapes = [], {}
    for f in files:
        fp = os.path.join(path, f)
        if not os.path.isfile(fp):
            problems.append(f"{f}: listed in the weight index but missing; re-save the model")
            continue
        if os.path.getsize(fp) == 0:
            problems.append(f"{f}: empty file (0 bytes): the final save was interrupted or wrote no weights; "
                            "save again (e.g. resume the run from its last checkpoint with training.max_steps reached)")
            continue
        try:
            with safe_open(fp, framework="pt") as fh:
                keys = list(fh.keys())
                for k in keys:
                    shapes[k] = tuple(fh.get_slice(k).get_shape())
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            problems.append(f"{f}: not a readable safetensors file ({e}); save the model again")
            continue
        if not keys:
            problems.append(f"{f}: holds no tensors; save the model again")
    return problems, shapes


def _weight_files(path: str) -> tuple[list[str], list[str]]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            files = sorted(set(json.load(fh).get("weight_map", {}).values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors") and not f.startswith("adapter_"))
    legacy = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth")) and f != "training_args.bin")
    return files, legacy


def _expected_shapes(path: str, trust_remote_code: bool, head: Head) -> dict[str, tuple[int, ...]]:
    """The shapes the config describes, named as save_pretrained writes them (MoE experts per expert), from a model
    built on the meta device (no memory, no weights)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = head.auto_class.from_config(config, trust_remote_code=trust_remote_code)
    return saved_shapes(model)


def _full_model_problems(path: str, trust_remote_code: bool, head: Head) -> list[str]:
    if not os.path.isfile(os.path.join(path, "config.json")):
        return ["config.json is missing: this is not a saved model (save_model writes it)"]
    files, legacy = _weight_files(path)
    if not files:
        hint = f" ({', '.join(legacy)} are not pushed: hftrain shares safetensors only)" if legacy else ""
        return [f"no safetensors weights in {path}{hint}; save the model with save_pretrained(safe_serialization=True)"]
    problems, saved = _safetensors_shapes(path, files)
    try:
        expected = _expected_shapes(path, trust_remote_code, head)
    except Exception as e:  # the config itself is broken: report it, do not crash
        return problems + [f"config.json does not build a {head.auto_class_name} ({type(e).__name__}: {e})"]
    for name in sorted(set(saved) & set(expected)):
        if saved[name] != expected[name]:
            hint = (" (an empty partition: ZeRO-3/FSDP weights were saved unconsolidated; hftrain's save gathers "
                    "them, so save through a recipe script or gather before saving)") if 0 in saved[name] else ""
            problems.append(f"{name}: saved shape {list(saved[name])}, the config needs {list(expected[name])}{hint}")
    if problems:
        return problems  # loading broken weights would only repeat these
    generation = _generation_config_problems(path) if head.generates else []
    return _load_and_generate(path, trust_remote_code, head) + generation


def _load_and_generate(path: str, trust_remote_code: bool, head: Head) -> list[str]:
    """from_pretrained on CPU (missing/unexpected keys reported), finite logits, and where the head generates, a few
    greedy tokens."""
    try:
        model, info = head.auto_class.from_pretrained(
            path, device_map="cpu", trust_remote_code=trust_remote_code, output_loading_info=True)
    except Exception as e:
        return [f"from_pretrained({path!r}) fails on CPU: {type(e).__name__}: {str(e).splitlines()[0]}"]
    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(map(str, info.get(kind) or []))
        if keys:
            problems.append(f"from_pretrained reports {kind.replace('_', ' ')}: {', '.join(keys[:5])}"
                            + (f" and {len(keys) - 5} more" if len(keys) > 5 else "") + "; save the model again")
    _, tok = _tokenizer_problems(path)
    if tok is None or problems:
        return problems
    model.eval()
    text = "Hello"
    if tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                       add_generation_prompt=True)
    enc = tok(text, return_tensors="pt", add_special_tokens=not tok.chat_template)
    with torch.no_grad():
        logits = model(**enc).logits
        if not torch.isfinite(logits).all():
            return ["the model's logits are not finite (NaN/inf) on a short prompt: the weights are broken"]
        if not head.generates:
            return problems
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        out = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=pad)
    if out.shape[1] <= enc["input_ids"].shape[1]:
        problems.append("generate() produced no token on a short prompt")
    return problems


def _generation_config_problems(path: str) -> list[str]:
    if not os.path.isfile(os.path.join(path, "generation_config.json")):
        return ["generation_config.json is missing, so generate() has no EOS to stop at; write one with "
                "GenerationConfig(eos_token_id=<the tokenizer's eos id>).save_pretrained(folder)"]
    cfg = GenerationConfig.from_pretrained(path)
    if cfg.eos_token_id is None:
        return ["generation_config.json has no eos_token_id, so generate() never stops: set it to the tokenizer's "
                "eos id (GenerationConfig.from_pretrained(folder); .eos_token_id = ID; .save_pretrained(folder))"]
    return []


def _tokenizer_problems(path: str):
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
    if not any(os.path.isfile(os.path.join(path, n)) for n in names):
        return [f"no tokenizer in {path} (tokenizer.json / tokenizer_config.json): copy the base model's tokenizer "
                "files into it, or save it with tokenizer.save_pretrained(folder)"], None
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        return [f"the tokenizer in {path} does not load ({type(e).__name__}: {str(e).splitlines()[0]})"], None
    if not tok.chat_template:
        return [f"the tokenizer in {path} has no chat template (chat_template.jinja): set data.chat_template in the "
                "recipe, or write the template to chat_template.jinja"], tok
    return [], tok


def adapter_problems(path: str, merged: str | None, head: Head = Head.CAUSAL_LM,
                     base_options: dict | None = None) -> list[str]:
    weights = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        return [f"adapter_model.safetensors is missing in {path}; save the adapter with save_pretrained"]
    problems, _ = _safetensors_shapes(path, ["adapter_model.safetensors"])
    if problems:
        return problems
    tensors = load_file(weights)
    lora = {k: v for k, v in tensors.items() if ".lora_" in k}
    others = [k for k in tensors if ".lora_" not in k]  # modules_to_save: full copies
    a_zero = all(not v.any() for k, v in lora.items() if "lora_A" in k or "lora_embedding_A" in k)
    b_zero = all(not v.any() for k, v in lora.items() if "lora_B" in k or "lora_embedding_B" in k)
    if lora and (a_zero or b_zero) and not others:
        return [f"the LoRA adapter in {path} is all zeros ({'lora_B' if b_zero else 'lora_A'} everywhere): peft starts "
                "lora_B at zero, so this adapter is the base model unchanged. Training did not update it "
                "(learning_rate 0, no steps, or the wrong modules); train again"]
    with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as fh:
        base_path = json.load(fh).get("base_model_name_or_path")
    if not base_path:
        return ["adapter_config.json names no base_model_name_or_path; save the adapter with peft's save_pretrained"]
    try:
        from peft import PeftModel  # optional dependency (LoRA runs only); inside the try: its absence is reported

        base = head.auto_class.from_pretrained(base_path, **{"dtype": torch.float32, "device_map": "cpu",
                                                             **(base_options or {})})
        if "quantization_config" in (base_options or {}):  # the kernel it trained through, not a bf16 inference one
            base = keep_training_kernels(base)
        adapted = PeftModel.from_pretrained(base, path).eval()
    except Exception as e:
        return [f"the adapter does not load onto its base {base_path!r}: {type(e).__name__}: {str(e).splitlines()[0]}"]
    if merged is None:
        return []
    try:
        merged_model = head.auto_class.from_pretrained(merged, dtype=torch.float32, device_map="cpu").eval()
    except Exception as e:
        return [f"the merged model in {merged} does not load: {type(e).__name__}: {str(e).splitlines()[0]}"]
    ids = torch.tensor(PROBE_IDS) % merged_model.config.get_text_config().vocab_size  # a VLM's is its text model's
    with torch.no_grad():
        ref = adapted(input_ids=ids).logits
        got = merged_model(input_ids=ids).logits
    # Equal up to float rounding of the merge (and the merged dtype when it was saved in 16 bits).
    scale = max(1.0, ref.abs().max().item())
    saved = read_json(os.path.join(merged, "config.json"))
    tol = (1e-4 if saved.get("dtype", saved.get("torch_dtype", "float32")) == "float32" else 2e-2) * scale
    diff = (ref - got).abs().max().item()
    if diff > tol:
        return [f"the merged model in {merged} does not match base + adapter (max logit difference {diff:.3g} > "
                f"{tol:.3g}): merge again (model.lora.merge) from this adapter"]
    return []
