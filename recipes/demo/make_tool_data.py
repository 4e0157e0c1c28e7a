"""Generate the tool-use demo's data: add two 5-digit numbers with a calculator tool.

    python recipes/demo/make_tool_data.py     # writes data/demo/tools_{sft,train,eval}.jsonl

A task the tiny demo model cannot do in its head (its digits are not the sum of the prompt's digits it could learn in
minutes) but can with the tool: copy the two numbers into a call of `add`, then copy the tool's answer. tools_sft.jsonl
holds demonstrations of that (the SFT warm start), tools_train.jsonl the prompts GRPO samples from with their
reference sums, tools_eval.jsonl held-out prompts whose pairs never appear in the other two.
"""

import importlib.util
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))


def add_schema() -> dict:
    """The JSON schema of calculator.add as transformers builds it for the chat template (as TRL does for GRPO)."""
    from transformers.utils import get_json_schema

    spec = importlib.util.spec_from_file_location("calculator", os.path.join(HERE, "calculator.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return get_json_schema(module.add)


def demonstration(a: int, b: int, schema: dict) -> dict:
    return {"messages": [
        {"role": "user", "content": f"{a} + {b}"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]},
        {"role": "tool", "name": "add", "content": str(a + b)},
        {"role": "assistant", "content": str(a + b)},
    ], "tools": [schema]}


def prompt(a: int, b: int) -> dict:
    return {"messages": [{"role": "user", "content": f"{a} + {b}"}, {"role": "assistant", "content": str(a + b)}]}


def main(out_dir: str = "data/demo", n_sft: int = 3000, n_train: int = 2000, n_eval: int = 200, seed: int = 0):
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()

    def pairs(n: int) -> list[tuple[int, int]]:
        out = []
        while len(out) < n:
            pair = (rng.randint(10000, 99999), rng.randint(10000, 99999))
            if pair not in seen:
                seen.add(pair)
                out.append(pair)
        return out

    schema = add_schema()
    splits = {"eval": [prompt(a, b) for a, b in pairs(n_eval)],
              "sft": [demonstration(a, b, schema) for a, b in pairs(n_sft)],
              "train": [prompt(a, b) for a, b in pairs(n_train)]}
    os.makedirs(out_dir, exist_ok=True)
    for split, rows in splits.items():
        with open(os.path.join(out_dir, f"tools_{split}.jsonl"), "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
