"""Sharing a finished run on the Hub: validate the exact folder, write its model card, upload it with retries.

    output_dir ──► stage_folder ──► <output_dir>/hub_upload/  (weights, tokenizer, configs, README.md card)
                                         │ validate_folder: refused with every problem, nothing uploaded
                                         ▼
                   push ──► huggingface_hub.HfApi: create_repo(exist_ok) + upload_folder, bounded retries

The token is read by huggingface_hub (HF_TOKEN or the stored `hf auth login`); hftrain never writes or prints it.
Nothing here speaks HTTP itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time

from . import distributed

STAGE_DIR = "hub_upload"  # inside output_dir: the exact folder uploaded, kept for inspection
CARD_FILE = "README.md"
# Top-level files of a run that may be shared. Pickles (training_args.bin, *.bin/*.pt weights) and
# checkpoints, TensorBoard logs and the merged/ folder (pushed only with merge_lora) stay local.
UPLOAD_SUFFIXES = (".safetensors", ".json", ".jinja", ".yaml", ".yml", ".txt", ".model", ".png")
NO_TOKEN = ("no Hugging Face token found: set HF_TOKEN in the environment or run `hf auth login` on this machine "
            "(a recipe never holds the token)")
# Hub user access tokens: "hf_" + 34 letters/digits. A match in a text file means a pasted token.
TOKEN_PATTERN = re.compile(rb"\bhf_[A-Za-z0-9]{30,}\b")
PROBE_IDS = [[1, 5, 9, 13, 17, 21, 25, 29]]


class HubError(ValueError):
    """A run that cannot (or could not) be pushed: what is wrong and how to fix it."""

    def __init__(self, problems: list[str] | str, header: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if header is None and len(self.problems) == 1:
            super().__init__(self.problems[0])
        else:
            super().__init__((header or "refusing to push") + ":\n" + "\n".join(f"  - {p}" for p in self.problems))


def option_problems(hub, lora) -> list[tuple[str, str]]:
    """Rules of the recipe's `hub:` section (types are already checked)."""
    out = []
    if hub.push is True and not hub.repo_id:
        out.append(("hub.repo_id", "hub.push is true but no repository is named: set hub.repo_id: your-name/model-name"))
    if isinstance(hub.repo_id, str) and hub.repo_id:
        msg = repo_id_problem(hub.repo_id)
        if msg:
            out.append(("hub.repo_id", msg))
    if hub.merge_lora is True and lora is None:
        out.append(("hub.merge_lora", "needs a LoRA run (model.lora); a full fine-tune is pushed as it is"))
    elif hub.merge_lora is True and getattr(lora, "merge", None) is False:
        out.append(("hub.merge_lora", "needs model.lora.merge: true, which writes the merged model to output_dir/merged"))
    return out


def repo_id_problem(repo_id: str) -> str | None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        return f"{repo_id!r} is not a repository id ({str(e).splitlines()[0]}); write your-name/model-name"
    return None


# ----------------------------------------------------------------------------------------------------------------
# Validation


def validate_folder(path: str, merged: str | None = None, trust_remote_code: bool = False) -> list[str]:
    """Everything wrong with the model folder `path` as a Hub upload; [] when it is fit to push.

    A full model: safetensors shards non-empty with the config's shapes, loads with from_pretrained on CPU and
    generates, tokenizer + chat template, generation_config EOS. A LoRA adapter (adapter_config.json): not all
    zero, loads onto its base, and when `merged` (a merged full model) is given, base + adapter logits == merged.
    """
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        problems = _adapter_problems(path, merged)
    else:
        problems = _full_model_problems(path, trust_remote_code)
    tok_problems, _ = _tokenizer_problems(path)
    return problems + tok_problems


def _safetensors_shapes(path: str, files: list[str]) -> tuple[list[str], dict[str, tuple[int, ...]]]:
    from safetensors import safe_open

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


def _expected_shapes(path: str, trust_remote_code: bool) -> dict[str, tuple[int, ...]]:
    """The state_dict shapes the config describes, from a model built on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _full_model_problems(path: str, trust_remote_code: bool) -> list[str]:
    if not os.path.isfile(os.path.join(path, "config.json")):
        return ["config.json is missing: this is not a saved model (save_model writes it)"]
    files, legacy = _weight_files(path)
    if not files:
        hint = f" ({', '.join(legacy)} are not pushed: hftrain shares safetensors only)" if legacy else ""
        return [f"no safetensors weights in {path}{hint}; save the model with save_pretrained(safe_serialization=True)"]
    problems, saved = _safetensors_shapes(path, files)
    try:
        expected = _expected_shapes(path, trust_remote_code)
    except Exception as e:  # the config itself is broken: report it, do not crash
        return problems + [f"config.json does not build a causal LM ({type(e).__name__}: {e})"]
    for name in sorted(set(saved) & set(expected)):
        if saved[name] != expected[name]:
            hint = (" (an empty partition: ZeRO-3/FSDP weights were saved unconsolidated; hftrain's save gathers "
                    "them, so save through recipes/sft.py or gather before saving)") if 0 in saved[name] else ""
            problems.append(f"{name}: saved shape {list(saved[name])}, the config needs {list(expected[name])}{hint}")
    if problems:
        return problems  # loading broken weights would only repeat these
    return _load_and_generate(path, trust_remote_code) + _generation_config_problems(path)


def _load_and_generate(path: str, trust_remote_code: bool) -> list[str]:
    """from_pretrained on CPU (missing/unexpected keys reported) and a few greedy tokens with finite logits."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(
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
        text = tok.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True)
    enc = tok(text, return_tensors="pt", add_special_tokens=not tok.chat_template)
    with torch.no_grad():
        logits = model(**enc).logits
        if not torch.isfinite(logits).all():
            return ["the model's logits are not finite (NaN/inf) on a short prompt: the weights are broken"]
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        out = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=pad)
    if out.shape[1] <= enc["input_ids"].shape[1]:
        problems.append("generate() produced no token on a short prompt")
    return problems


def _generation_config_problems(path: str) -> list[str]:
    from transformers import GenerationConfig

    if not os.path.isfile(os.path.join(path, "generation_config.json")):
        return ["generation_config.json is missing, so generate() has no EOS to stop at; write one with "
                "GenerationConfig(eos_token_id=<the tokenizer's eos id>).save_pretrained(folder)"]
    cfg = GenerationConfig.from_pretrained(path)
    if cfg.eos_token_id is None:
        return ["generation_config.json has no eos_token_id, so generate() never stops: set it to the tokenizer's "
                "eos id (GenerationConfig.from_pretrained(folder); .eos_token_id = ID; .save_pretrained(folder))"]
    return []


def _tokenizer_problems(path: str):
    from transformers import AutoTokenizer

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


def _adapter_problems(path: str, merged: str | None) -> list[str]:
    import torch
    from safetensors.torch import load_file

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
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, device_map="cpu")
        adapted = PeftModel.from_pretrained(base, path).eval()
    except Exception as e:
        return [f"the adapter does not load onto its base {base_path!r}: {type(e).__name__}: {str(e).splitlines()[0]}"]
    if merged is None:
        return []
    try:
        merged_model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32, device_map="cpu").eval()
    except Exception as e:
        return [f"the merged model in {merged} does not load: {type(e).__name__}: {str(e).splitlines()[0]}"]
    ids = torch.tensor(PROBE_IDS) % merged_model.config.vocab_size
    with torch.no_grad():
        ref = adapted(input_ids=ids).logits
        got = merged_model(input_ids=ids).logits
    # Equal up to float rounding of the merge (and the merged dtype when it was saved in 16 bits).
    scale = max(1.0, ref.abs().max().item())
    saved = _read_json(os.path.join(merged, "config.json"))
    tol = (1e-4 if saved.get("dtype", saved.get("torch_dtype", "float32")) == "float32" else 2e-2) * scale
    diff = (ref - got).abs().max().item()
    if diff > tol:
        return [f"the merged model in {merged} does not match base + adapter (max logit difference {diff:.3g} > "
                f"{tol:.3g}): merge again (model.lora.merge) from this adapter"]
    return []


# ----------------------------------------------------------------------------------------------------------------
# Staging and the model card


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _shareable(folder: str) -> list[str]:
    return sorted(f for f in os.listdir(folder) if os.path.isfile(os.path.join(folder, f))
                  and f.endswith(UPLOAD_SUFFIXES) and ".tmp-" not in f)


def _hub_id(name: str | None) -> bool:
    """A Hub repository id rather than a local path (the card's metadata may only name Hub repositories)."""
    if not name or os.path.exists(name) or name.startswith((".", "/", "~")):
        return False
    if name.endswith((".json", ".jsonl", ".parquet", ".csv", ".txt", ".arrow")):
        return False
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name) is not None


def _fenced(lang: str, text: str) -> str:
    fence = "````" if "```" in text else "```"
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}\n"


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def build_card(output_dir: str, files: list[str], repo_id: str | None = None, license: str | None = None,
               merged: bool = False):
    """The model card (huggingface_hub.ModelCard): metadata, results, curves, how it was made, the recipe and configs.

    Everything comes from what the run wrote into output_dir: recipe.yaml (resolved), run_info.json (engine, world
    size, metrics), the strategy's accelerate/DeepSpeed configs and curves.png.
    """
    import yaml
    from huggingface_hub import ModelCard, ModelCardData

    recipe_text = open(os.path.join(output_dir, "recipe.yaml"), encoding="utf-8").read()
    recipe = yaml.safe_load(recipe_text) or {}
    info = _read_json(os.path.join(output_dir, "run_info.json"))
    model, data = recipe.get("model") or {}, recipe.get("data") or {}
    base = model.get("name_or_path")
    lora = model.get("lora")
    adapter = bool(lora) and not merged
    sources = [s.get("path") for s in (data.get("sources") or []) + (data.get("eval_sources") or []) if isinstance(s, dict)]
    strategy = info.get("strategy") or (recipe.get("strategy") or {}).get("name") or "ddp"
    tags = ["hftrain", "sft", strategy] + (["lora", "peft"] if lora else [])
    card_data = ModelCardData(
        base_model=base if _hub_id(base) else None,
        datasets=[s for s in sources if _hub_id(s)] or None,
        library_name="peft" if adapter else "transformers",
        license=license,
        pipeline_tag="text-generation",
        tags=tags,
    )
    name = repo_id or os.path.basename(os.path.normpath(output_dir))
    kind = "A LoRA adapter" if adapter else ("base + LoRA merged" if lora else "A full fine-tune")
    base_ref = f"[`{base}`](https://huggingface.co/{base})" if _hub_id(base) else f"`{base}` (a local model)"
    lines = [f"# {name}", "",
             f"{kind} of {base_ref}, trained by supervised fine-tuning with hftrain"
             + (f" (LoRA r={lora.get('r')}, alpha={lora.get('alpha')}, target modules {lora.get('target_modules')})"
                if lora else "") + ".", ""]

    metrics = {k: v for k, v in (info.get("metrics") or {}).items() if isinstance(v, (int, float))}
    lines += ["## Results", ""]
    if metrics:
        lines += ["| metric | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in sorted(metrics.items())]
    else:
        lines.append("No metrics were recorded (run_info.json is missing).")
    if "curves.png" in files:
        lines += ["", "![Loss, learning rate and throughput against the step](curves.png)"]

    ident = repo_id or "<repo_id>"
    if adapter:
        use = (f"from peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer\n\n"
               f"model = AutoPeftModelForCausalLM.from_pretrained({json.dumps(ident)})\n"
               f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(ident)})\n")
    else:
        use = (f"from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
               f"model = AutoModelForCausalLM.from_pretrained({json.dumps(ident)})\n"
               f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(ident)})\n")
    use += ('messages = [{"role": "user", "content": "Hello"}]\n'
            "ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\")\n"
            "print(tokenizer.decode(model.generate(ids, max_new_tokens=64)[0][ids.shape[1]:]))\n")
    lines += ["", "## Use", "", _fenced("python", use)]

    engine = ", ".join(f"{k} {info[k]}" for k in ("wrapper", "zero_stage", "offload_param", "offload_optimizer")
                       if info.get(k) is not None)
    lines += ["## How it was made", "",
              f"- strategy: `{strategy}`" + (f" ({engine})" if engine else ""),
              f"- world size: {info.get('world_size', '?')} process(es)" + (
                  f", backend {info['backend']}" if info.get("backend") else ""),
              f"- optimizer steps: {info.get('global_step', '?')}",
              f"- data: {', '.join(f'`{s}`' for s in sources) or '?'}"]
    for section in ("compression", "moe"):  # present in the recipe when the run used them
        if recipe.get(section):
            lines += [f"- {section}:", "", _fenced("yaml", yaml.safe_dump(recipe[section], sort_keys=False))]
    lines += ["", "### Recipe (resolved: defaults + YAML + command line)", "", _fenced("yaml", recipe_text)]
    configs = [f for f in files if os.path.splitext(f)[0] == strategy and f.endswith((".yaml", ".json"))]
    if configs:
        lines += ["### Launcher configs generated for this run", ""]
        for f in configs:
            lines += [f"`{f}`:", "", _fenced("json" if f.endswith(".json") else "yaml",
                                             open(os.path.join(output_dir, f), encoding="utf-8").read())]
    lines += ["### Files", "", ", ".join(f"`{f}`" for f in files), ""]
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + "\n".join(lines))


def _place(src: str, dst: str) -> None:
    """Hard link when possible (weights can be large; the run never rewrites a saved file in place), else copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def stage_folder(output_dir: str, dest: str, merge_lora: bool = False, repo_id: str | None = None,
                 license: str | None = None) -> list[str]:
    """Write the exact folder to upload into `dest` (replaced whole): model files, run records, README.md card.

    With merge_lora the model files come from output_dir/merged instead of the adapter. Returns the file names.
    """
    if not os.path.isfile(os.path.join(output_dir, "recipe.yaml")):
        raise HubError(f"{output_dir} has no recipe.yaml: not a finished hftrain run (recipes/sft.py writes it)")
    sources: dict[str, str] = {}
    if merge_lora:
        merged = os.path.join(output_dir, "merged")
        if not os.path.isdir(merged):
            raise HubError(f"{merged} is missing: merge_lora pushes the merged model that model.lora.merge: true "
                           "writes at the end of training; rerun with it, or push the adapter")
        sources = {f: os.path.join(merged, f) for f in _shareable(merged)}
    for f in _shareable(output_dir):
        if merge_lora and f.startswith("adapter_"):
            continue
        sources.setdefault(f, os.path.join(output_dir, f))
    partial = dest.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    for f, src in sorted(sources.items()):
        _place(src, os.path.join(partial, f))
    files = sorted([*sources, CARD_FILE])
    build_card(output_dir, files, repo_id=repo_id, license=license, merged=merge_lora).save(
        os.path.join(partial, CARD_FILE))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(partial, dest)
    return files


def token_problems(folder: str, token: str | None) -> list[str]:
    """Files that hold a Hub token (this one, or anything shaped like one): they must not be uploaded."""
    out = []
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            continue  # binary weights
        with open(os.path.join(folder, f), "rb") as fh:
            data = fh.read()
        if (token and token.encode() in data) or TOKEN_PATTERN.search(data):
            out.append(f"{f} contains a Hugging Face token: remove it from the run's files (tokens belong in HF_TOKEN "
                       "or `hf auth login`, never in a recipe or config) and revoke it at huggingface.co/settings/tokens")
    return out


# ----------------------------------------------------------------------------------------------------------------
# Push


def _retryable_errors() -> tuple[type[BaseException], ...]:
    """What an unreachable or failing Hub raises through huggingface_hub (its HTTP client's transport errors)."""
    from huggingface_hub.errors import HfHubHTTPError

    types: list[type[BaseException]] = [HfHubHTTPError, OSError]
    for mod in ("httpx2", "httpx"):  # huggingface_hub's HTTP client, whichever this version uses
        try:
            types.append(__import__(mod).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(types)


def _status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def push(output_dir: str, hub, *, dry_run: bool = False, stage_dir: str | None = None, endpoint: str | None = None,
         attempts: int = 3, backoff_s: float = 2.0, trust_remote_code: bool = False) -> str:
    """Validate and upload output_dir as `hub.repo_id` (a `HubSection`). Returns the commit URL (the staged folder
    for a dry run). Raises HubError: nothing uploaded when validation fails; after `attempts` failed uploads the
    local files are untouched and the same command can simply be run again.
    """
    from huggingface_hub import get_token

    if not hub.repo_id:
        raise HubError("no repository named: pass --repo-id your-name/model-name (or set hub.repo_id in the recipe)")
    problem = repo_id_problem(hub.repo_id)
    if problem:
        raise HubError(problem)
    token = None
    if not dry_run:
        token = get_token()  # HF_TOKEN, else the stored login
        if not token:
            raise HubError(NO_TOKEN)
    stage = stage_dir or os.path.join(output_dir, STAGE_DIR)
    files = stage_folder(output_dir, stage, hub.merge_lora, hub.repo_id, hub.license)
    merged_ref = os.path.join(output_dir, "merged")
    if hub.merge_lora:
        # The merged model pushed must equal base + the run's adapter.
        problems = validate_folder(stage, trust_remote_code=trust_remote_code) + _adapter_problems(output_dir, stage)
    else:
        problems = validate_folder(stage, merged_ref if os.path.isdir(merged_ref) else None, trust_remote_code)
    problems += token_problems(stage, token)
    if problems:
        shutil.rmtree(stage, ignore_errors=True)
        raise HubError(problems, header=f"refusing to push {output_dir}: {len(problems)} problem(s), nothing uploaded")
    print(f"hftrain: validated {stage} ({len(files)} files): " + ", ".join(files), flush=True)
    if dry_run:
        print(f"hftrain: dry run: this folder is what `hftrain push` would upload to {hub.repo_id}", flush=True)
        return stage

    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    message = hub.commit_message or f"hftrain: upload {os.path.basename(os.path.normpath(output_dir))}"
    retryable = _retryable_errors()
    last = None
    for attempt in range(1, attempts + 1):
        try:
            api.create_repo(hub.repo_id, private=hub.private, exist_ok=True)
            if hub.revision:
                api.create_branch(hub.repo_id, branch=hub.revision, exist_ok=True)
            info = api.upload_folder(repo_id=hub.repo_id, folder_path=stage, revision=hub.revision,
                                     commit_message=message)
            print(f"hftrain: pushed {len(files)} files to {hub.repo_id}"
                  + (f" (branch {hub.revision})" if hub.revision else "") + f": {info.commit_url}", flush=True)
            return info.commit_url
        except ValueError as e:  # huggingface_hub's answer to a card the Hub refuses (not worth retrying)
            raise HubError(f"the Hub refused the upload to {hub.repo_id}: {e}") from None
        except retryable as e:
            if _status(e) in (401, 403):
                raise HubError(f"the Hub refused the token for {hub.repo_id} ({_one_line(e)}): use a token with write "
                               "access to that namespace (HF_TOKEN or `hf auth login`)") from None
            last = e
            if attempt < attempts:
                wait = backoff_s * 2 ** (attempt - 1)
                print(f"hftrain: push attempt {attempt}/{attempts} failed ({_one_line(e)}); retrying in {wait:g}s",
                      flush=True)
                time.sleep(wait)
    raise HubError(
        f"pushing to {hub.repo_id} failed {attempts} times; last error: {_one_line(last)}. Nothing local changed: "
        f"{output_dir} is complete and the validated upload is in {stage}. Run `{rerun_command(output_dir, hub)}` "
        "again once the Hub is reachable") from None


def rerun_command(output_dir: str, hub) -> str:
    import shlex

    cmd = ["hftrain", "push", output_dir, "--repo-id", hub.repo_id]
    cmd += ["--private"] if hub.private else []
    cmd += ["--revision", hub.revision] if hub.revision else []
    cmd += ["--commit-message", hub.commit_message] if hub.commit_message else []
    cmd += ["--merge-lora"] if hub.merge_lora else []
    cmd += ["--license", hub.license] if hub.license else []
    return " ".join(shlex.quote(c) for c in cmd)


def check_token(hub) -> None:
    """Before training: a run that will push needs a token now, not after hours of training."""
    from huggingface_hub import get_token

    if hub.push and not get_token():
        raise HubError(NO_TOKEN + " (hub.push is true)")


def push_after_training(recipe) -> str | None:
    """recipes/sft.py's last step when hub.push is set: the main process validates and uploads output_dir."""
    if not recipe.hub.push or not distributed.is_main_process():
        return None
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    # The run's ZeRO-3 config stays registered with transformers while its TrainingArguments live; validation
    # loads the saved folder as a plain CPU model, not under zero.Init.
    unset_hf_deepspeed_config()
    return push(recipe.output_dir, recipe.hub, trust_remote_code=recipe.model.trust_remote_code)


def settings_for_run(output_dir: str, **overrides):
    """The run's own `hub:` settings (from output_dir/recipe.yaml) with the command line's values on top."""
    from .recipe import HubSection, load_recipe

    path = os.path.join(output_dir, "recipe.yaml")
    if not os.path.isfile(path):
        raise HubError(f"{output_dir} has no recipe.yaml: not a finished hftrain run (recipes/sft.py writes it)")
    recipe = load_recipe(path)
    hub = recipe.hub if isinstance(recipe.hub, HubSection) else HubSection()
    hub = dataclasses.replace(hub, **{k: v for k, v in overrides.items() if v is not None})
    problems = [f"{k}: {m}" for k, m in option_problems(dataclasses.replace(hub, push=False), recipe.model.lora)]
    if problems:
        raise HubError(problems, header="cannot push")
    return hub, recipe
