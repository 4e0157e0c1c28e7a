"""Generate the demo chat dataset: reverse a short sequence of letters.

    python recipes/demo/make_data.py          # writes data/demo/train.jsonl and data/demo/eval.jsonl

A task a tiny model learns on a CPU in a minute and that exact match can judge: the answer is fully
determined by the prompt, and held-out prompts are sequences never seen in training.
"""

import json
import os
import random

LETTERS = "abcdefghij"


def example(rng: random.Random) -> tuple[str, dict]:
    seq = [rng.choice(LETTERS) for _ in range(rng.randint(3, 6))]
    key = " ".join(seq)
    return key, {
        "messages": [
            {"role": "user", "content": f"reverse: {key}"},
            {"role": "assistant", "content": " ".join(reversed(seq))},
        ]
    }


def main(out_dir: str = "data/demo", n_train: int = 4000, n_eval: int = 200, seed: int = 0) -> None:
    rng = random.Random(seed)
    seen: set[str] = set()
    splits = {"train": [], "eval": []}
    for split, n in (("eval", n_eval), ("train", n_train)):
        while len(splits[split]) < n:
            key, ex = example(rng)
            if split == "train" and key in seen:  # held-out prompts never appear in training
                continue
            if split == "eval":
                if key in seen:
                    continue
                seen.add(key)
            splits[split].append(ex)
    os.makedirs(out_dir, exist_ok=True)
    for split, rows in splits.items():
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
