"""Rows per second of the per-row tokenising function (hftrain.data.tokenize_examples), one process, per template
family and kind of conversation, and the examples each row becomes.

    python bench/template_rows.py [--rows 300] [--families qwen2_5 qwen3 ...]

The families and conversations are the oracle test's (tests/template_families.py, tests/test_template_oracle.py):
real chat templates, tokenizers trained locally. What it shows: the cost of rendering turn by turn (each prefix of
a conversation once), of the probes that find what a template reads (once per template), and of the examples a
template that rewrites earlier turns makes a conversation into (Qwen3: one per turn written differently later).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hftrain.data import to_messages_or_text, tokenize_examples  # noqa: E402
from hftrain.errors import DataError  # noqa: E402
from tests.template_families import FAMILIES, tokenizer_for  # noqa: E402
from tests.test_template_oracle import CONVERSATIONS  # noqa: E402

KINDS = ("single", "multi_turn", "tool_call", "reasoning_multi_turn", "reasoning_tools")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--families", nargs="+", default=["qwen2_5", "llama3_1", "qwen3", "glm4moe", "gptoss"])
    args = ap.parse_args()
    print(f"{'family':12s} {'conversation':22s} {'rows/s':>7s} {'examples/row':>12s}")
    for name in args.families:
        tok = tokenizer_for(FAMILIES[name], tempfile.mkdtemp())
        for kind in KINDS:
            raw, tools = CONVERSATIONS[kind]
            canon = to_messages_or_text({"messages": raw, **({"tools": tools} if tools else {})}, "messages", True)
            try:
                n = len(tokenize_examples(canon, tok, False))  # the first call also runs the template's probes
            except DataError:
                print(f"{name:12s} {kind:22s} {'refused':>7s}")
                continue
            start = time.perf_counter()
            for _ in range(args.rows):
                tokenize_examples(canon, tok, False)
            print(f"{name:12s} {kind:22s} {args.rows / (time.perf_counter() - start):7.0f} {n:12d}")


if __name__ == "__main__":
    main()
