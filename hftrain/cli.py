"""The `hftrain` command: `check` a recipe, build a `tiny-model` for demos and tests."""

from __future__ import annotations

import argparse
import json
import sys


def _check(ns) -> int:
    from .recipe import load_recipe

    recipe = load_recipe(ns.recipe, ns.overrides)
    print(recipe.to_yaml(), end="")
    return 0


def _tiny_model(ns) -> int:
    from .tiny import build_tiny_model, texts_of_jsonl

    config = json.loads(ns.config) if ns.config else None
    out = build_tiny_model(ns.output, texts_of_jsonl(ns.data), config=config, vocab_size=ns.vocab_size, seed=ns.seed)
    print(f"hftrain: tiny model with a locally trained tokenizer written to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hftrain", allow_abbrev=False, description="Fine-tune LLMs from one YAML recipe.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("check", allow_abbrev=False, help="Validate a recipe and print it resolved (defaults + YAML + overrides).")
    c.add_argument("recipe", help="recipe YAML")
    c.add_argument("overrides", nargs="*", help="section.key=value overrides")
    c.set_defaults(fn=_check)

    t = sub.add_parser(
        "tiny-model", allow_abbrev=False,
        help="Build a tiny Llama-style model (random weights) with a tokenizer trained on JSONL files. No Hub needed.",
    )
    t.add_argument("--data", nargs="+", required=True, help="JSONL files whose strings train the tokenizer")
    t.add_argument("--output", required=True, help="folder to write the model and tokenizer to")
    t.add_argument("--config", default=None, help='JSON of LlamaConfig overrides, e.g. \'{"num_hidden_layers": 4}\'')
    t.add_argument("--vocab-size", type=int, default=512)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(fn=_tiny_model)
    return p


def main(argv: list[str] | None = None) -> int:
    from .errors import exit_on_user_error

    ns = build_parser().parse_args(argv)
    with exit_on_user_error():
        return ns.fn(ns)


if __name__ == "__main__":
    sys.exit(main())
