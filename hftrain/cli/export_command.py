"""`hftrain export RUN`: what a finished run is served as (hftrain/serving/). --merged: an adapter run's base +
adapter as plain safetensors (RUN/merged); --gguf TYPES: GGUF files through llama.cpp's own converter (of the merged
weights for an adapter run), each loaded back and compared with the trained model on the run's held-out prompts."""

from __future__ import annotations

import json
import os

from ..constants import RECIPE_FILE
from ..errors import ModelError
from ..methods import load_recipe
from ..serving import GGUF_TYPES, check_gguf, convert, converter_dir, merged_folder, trained_reference

CHECKED_PROMPTS = 8
DEFAULT_MAX_NEW_TOKENS = 32


def run_recipe(run: str):
    """A run folder's recipe (None for a plain model folder)."""
    path = os.path.join(run, RECIPE_FILE)
    return load_recipe(path) if os.path.isfile(path) else None


def prompt_messages(messages: list) -> list:
    """A conversation's messages before its first answer."""
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    return messages[:roles.index("assistant")] if "assistant" in roles else []


def held_out_examples(recipe, rows: str | None, limit: int) -> list[dict]:
    """The first held-out conversations (--check-rows, else the run's data.eval_sources), each its prompt only."""
    paths = [rows] if rows else []
    if not rows and recipe is not None:
        paths = [s.path for s in recipe.data.eval_sources or [] if os.path.isfile(s.path)]
    examples = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                messages = (json.loads(line) if line.strip() else {}).get("messages")
                prompt = prompt_messages(messages) if isinstance(messages, list) else []
                if prompt:
                    examples.append({"messages": prompt})
                if len(examples) == limit:
                    return examples
    return examples


def gguf_types(given: str) -> list[str]:
    types = [t for t in given.split(",") if t]
    unknown = [t for t in types if t not in GGUF_TYPES]
    if unknown or not types:
        raise ModelError(f"--gguf {given}: one or more of {', '.join(GGUF_TYPES)}, comma-separated")
    return types


def _export(ns) -> int:
    types = gguf_types(ns.gguf) if ns.gguf else []
    if not types and not ns.merged:
        raise ModelError("say what to export: --merged (an adapter run as plain safetensors) and/or --gguf TYPES")
    folder = converter_dir(ns.converter) if types else None
    recipe = run_recipe(ns.run)
    source = merged_folder(ns.run, recipe.model if recipe is not None else None)
    out_dir = ns.output or os.path.join(ns.run, "gguf")
    examples = held_out_examples(recipe, ns.check_rows, ns.check_prompts) if types else []
    reference = trained_reference(source, examples, ns.max_new_tokens) if types else None
    name = os.path.basename(os.path.normpath(ns.run))
    print("| type | file | size | largest logit difference | same greedy answers | same prompt ids |\n"
          "|---|---|---|---|---|---|"
          if types else f"hftrain: full weights in {source}")
    for gguf_type in types:
        os.makedirs(out_dir, exist_ok=True)
        path = convert(source, folder, gguf_type, os.path.join(out_dir, f"{name}-{gguf_type}.gguf"),
                       ns.pre_tokenizer)
        check = check_gguf(reference, path, gguf_type, ns.max_new_tokens)
        print(f"| {gguf_type} | {path} | {check.size_bytes / 2**20:.1f} MiB | {check.max_logit_difference:.3g} | "
              f"{check.same_answers}/{check.prompts} | {check.same_prompt_ids}/{check.prompts} |", flush=True)
    return 0


def add_export_command(sub) -> None:
    ex = sub.add_parser("export", allow_abbrev=False,
                        help="Export a finished run: an adapter run merged into plain safetensors, GGUF files for "
                             "llama.cpp and Ollama (each loaded back and compared with the trained model).")
    ex.add_argument("run", help="a run's folder (training.output_dir), or a model folder")
    ex.add_argument("--merged", action="store_true",
                    help="an adapter run's base + adapter as plain safetensors in RUN/merged")
    ex.add_argument("--gguf", help=f"GGUF types to write, comma-separated: {', '.join(GGUF_TYPES)}")
    ex.add_argument("--converter", help="the folder of llama.cpp's convert_hf_to_gguf.py (default: "
                                        "$HFTRAIN_LLAMA_CPP)")
    ex.add_argument("--pre-tokenizer", dest="pre_tokenizer",
                    help="the llama.cpp pre-tokenizer for a tokenizer its converter does not recognise (gpt-2, "
                         "llama-bpe, qwen2, ...)")
    ex.add_argument("--output", help="where the GGUF files go (default: RUN/gguf)")
    ex.add_argument("--check-rows", dest="check_rows",
                    help="held-out rows whose prompts both models answer (default: the run's data.eval_sources)")
    ex.add_argument("--check-prompts", dest="check_prompts", type=int, default=CHECKED_PROMPTS,
                    help=f"how many of their prompts (default {CHECKED_PROMPTS})")
    ex.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    ex.set_defaults(fn=_export)
