"""Generate the noisy demonstrations the tool-use GRPO demo's start is fine-tuned on: the tool-use demo's SFT rows
(recipes/demo/make_tool_data.py) answered without the tool 3 times in every 5 (the sum written at once, which the
tiny model cannot work out). Fine-tuned on them briefly, the SFT demo's model answers without the tool when it
answers greedily (wrongly) and calls the tool in some of its samples (then often rightly): what GRPO, rewarded by
exact match, learns from. The wrong answers are in the data, not in where rounding ends the SFT run, so the start is
the same on every CPU path.

    python recipes/demo/make_tool_noisy.py   # writes data/demo/tools_noisy.jsonl from data/demo/tools_sft.jsonl

The script remakes the file byte for byte.
"""

import json
import os

UNAIDED = (0, 1, 2)  # of each 5 rows, in file order, these answer without the tool


def unaided(row: dict) -> dict:
    """The row's question answered at once: no tool call, no tool turn (its tools still offered)."""
    question, *_, answer = row["messages"]
    return {"messages": [question, answer], "tools": row["tools"]}


def main(data_dir: str = "data/demo") -> None:
    with open(os.path.join(data_dir, "tools_sft.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    rows = [unaided(row) if k % 5 in UNAIDED else row for k, row in enumerate(rows)]
    out = os.path.join(data_dir, "tools_noisy.jsonl")
    with open(out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"{out}: {len(rows)} rows, {sum(len(r['messages']) == 2 for r in rows)} answered without the tool")


if __name__ == "__main__":
    main()
