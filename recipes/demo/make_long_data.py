"""Generate the long-context demo dataset: find a key hidden in a haystack of letters.

    python recipes/demo/make_long_data.py [--letters 30000] [--train 16] [--eval 2]
        # writes runs/demo/long_data/{train,eval}.jsonl (generated, not shipped: ~60 KB a row)

Each row is a prompt of about `letters` single letters (a..j, one token each with the demo tokenizer, so about as
many tokens) with "key: x y z ." somewhere inside, and the question; the completion is the key. The answer depends on
a span anywhere in the sequence: what long context is for. recipes/demo/long_context.yaml trains on it.
"""

import argparse
import json
import os
import random

LETTERS = "abcdefghij"


def example(rng: random.Random, letters: int) -> dict:
    key = " ".join(rng.choice(LETTERS) for _ in range(3))
    hay = [rng.choice(LETTERS) for _ in range(letters)]
    at = rng.randrange(letters)
    prompt = f"find the key: {' '.join(hay[:at])} key: {key} . {' '.join(hay[at:])} the key is"
    return {"prompt": prompt, "completion": f" {key}"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--letters", type=int, default=30000)
    p.add_argument("--train", type=int, default=16)
    p.add_argument("--eval", type=int, default=2)
    p.add_argument("--out", default="runs/demo/long_data")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    rng = random.Random(ns.seed)
    os.makedirs(ns.out, exist_ok=True)
    for split, n in (("train", ns.train), ("eval", ns.eval)):
        path = os.path.join(ns.out, f"{split}.jsonl")
        with open(path, "w", encoding="utf-8") as fh:
            for _ in range(n):
                fh.write(json.dumps(example(rng, ns.letters)) + "\n")
        print(f"wrote {n} rows to {path}")


if __name__ == "__main__":
    main()
