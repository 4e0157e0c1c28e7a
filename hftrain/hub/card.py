"""The model card of a run: the recipe, the launcher config, the metrics and how to load the result."""

from __future__ import annotations

import os
import re

import yaml
from huggingface_hub import ModelCard, ModelCardData

from ..constants import HARNESS_RESULTS_FILE, RECIPE_FILE, RUN_INFO_FILE
from ..fileio import read_json
from ..harness import Comparison, markdown
from ..heads import Head


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
    recipe_text = open(os.path.join(output_dir, RECIPE_FILE), encoding="utf-8").read()
    recipe = yaml.safe_load(recipe_text) or {}
    info = read_json(os.path.join(output_dir, RUN_INFO_FILE))
    model, data = recipe.get("model") or {}, recipe.get("data") or {}
    base = model.get("name_or_path")
    lora = model.get("lora")
    adapter = bool(lora) and not merged
    sources = [s.get("path") for s in (data.get("sources") or []) + (data.get("eval_sources") or [])
               if isinstance(s, dict)]
    strategy = info.get("strategy") or (recipe.get("strategy") or {}).get("name") or "ddp"
    trained_by = info.get("method") or {}  # the method as the run recorded it (methods.Method.card)
    method = trained_by.get("description") or "fine-tuning"
    head = Head.recorded(trained_by.get("head"))  # a run written before heads were recorded trained a causal LM
    tags = ["hftrain", *([trained_by["tag"]] if trained_by.get("tag") else []), strategy]
    tags += ["lora", "peft"] if lora else []
    card_data = ModelCardData(
        base_model=base if _hub_id(base) else None,
        datasets=[s for s in sources if _hub_id(s)] or None,
        library_name="peft" if adapter else "transformers",
        license=license,
        pipeline_tag=head.pipeline_tag,
        tags=tags,
    )
    name = repo_id or os.path.basename(os.path.normpath(output_dir))
    kind = "A LoRA adapter" if adapter else ("base + LoRA merged" if lora else "A full fine-tune")
    base_ref = f"[`{base}`](https://huggingface.co/{base})" if _hub_id(base) else f"`{base}` (a local model)"
    lines = [f"# {name}", "",
             f"{kind} of {base_ref}, trained by {method} with hftrain"
             + (f" (LoRA r={lora.get('r')}, alpha={lora.get('alpha')}, target modules {lora.get('target_modules')})"
                if lora else "") + ".", ""]

    lines += _results_lines(info, files) + _benchmark_lines(output_dir)
    lines += _use_lines(repo_id or "<repo_id>", adapter, head, trained_by.get("num_labels"),
                        _has_chat_template(output_dir))
    lines += _made_lines(output_dir, files, recipe, recipe_text, info, strategy, sources)
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + "\n".join(lines))


def _results_lines(info: dict, files: list[str]) -> list[str]:
    metrics = {k: v for k, v in (info.get("metrics") or {}).items() if isinstance(v, (int, float))}
    lines = ["## Results", ""]
    if metrics:
        lines += ["| metric | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in sorted(metrics.items())]
    else:
        lines.append("No metrics were recorded (run_info.json is missing).")
    if "curves.png" in files:
        lines += ["", "![Loss, learning rate and throughput against the step](curves.png)"]
    return lines


def _benchmark_lines(output_dir: str) -> list[str]:
    """`hftrain eval`'s table (eval_harness.json), when the run was evaluated."""
    path = os.path.join(output_dir, HARNESS_RESULTS_FILE)
    if not os.path.isfile(path):
        return []
    results = read_json(path)
    comparisons = [Comparison.from_dict(c) for c in results.get("comparisons") or []]
    limit = f", the first {results['limit']} rows of each task" if results.get("limit") else ""
    return ["", "## Benchmarks", "", f"lm-evaluation-harness through `hftrain eval`, against the base "
            f"`{results.get('base')}`{limit}:", "", markdown(comparisons)]


def _use_lines(ident: str, adapter: bool, head: Head, num_labels: int | None, chat_template: bool) -> list[str]:
    """How to load and prompt it (heads.Head.usage): the adapter through peft, anything else through transformers,
    by the Auto class of its head."""
    return ["", "## Use", "", _fenced("python", head.usage(ident, adapter, num_labels, chat_template))]


def _has_chat_template(output_dir: str) -> bool:
    """Whether the tokenizer saved beside the model has a chat template (its own file, or in tokenizer_config.json)."""
    if os.path.isfile(os.path.join(output_dir, "chat_template.jinja")):
        return True
    config = os.path.join(output_dir, "tokenizer_config.json")
    return os.path.isfile(config) and bool(read_json(config).get("chat_template"))


def _made_lines(output_dir: str, files: list[str], recipe: dict, recipe_text: str, info: dict, strategy: str,
                sources: list[str]) -> list[str]:
    """How it was made: the strategy and engine, world size, steps, data, the recipe and the launcher configs."""
    engine = ", ".join(f"{k} {info[k]}" for k in ("wrapper", "zero_stage", "offload_param", "offload_optimizer")
                       if info.get(k) is not None)
    lines = ["## How it was made", "",
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
    return lines + ["### Files", "", ", ".join(f"`{f}`" for f in files), ""]
