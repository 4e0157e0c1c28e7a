"""Generate the demo chat dataset: reverse a short sequence of letters.

    python recipes/demo/make_data.py          # writes data/demo/{train,eval}.jsonl and preference_{train,eval}.jsonl

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


def wrong_answer(seq: list[str], rng: random.Random) -> list[str]:
    """A plausible wrong reversal: the letters as given, two neighbours swapped, or one letter dropped."""
    rev = list(reversed(seq))
    kind = rng.choice(["echo", "swap", "drop"])
    if kind == "echo" and seq != rev:
        return list(seq)
    i = rng.randrange(len(rev) - 1)
    if kind != "drop" and rev[i] != rev[i + 1]:
        return rev[:i] + [rev[i + 1], rev[i]] + rev[i + 2:]
    return rev[:i] + rev[i + 1:]


def preference_pairs(out_dir: str = "data/demo", n_train: int = 1000, n_eval: int = 200, seed: int = 1) -> None:
    """Preference pairs for recipes/dpo.py: chosen the correct reversal, rejected a plausible wrong one; held-out
    prompts appear in no training file."""
    rng = random.Random(seed)
    seen = set()
    for name in ("train.jsonl", "eval.jsonl"):
        with open(os.path.join(out_dir, name), encoding="utf-8") as fh:
            seen.update(json.loads(line)["messages"][0]["content"] for line in fh)
    splits = {"preference_eval": [], "preference_train": []}
    for split, n in (("preference_eval", n_eval), ("preference_train", n_train)):
        while len(splits[split]) < n:
            seq = [rng.choice(LETTERS) for _ in range(rng.randint(3, 6))]
            prompt = f"reverse: {' '.join(seq)}"
            if split == "preference_eval" and prompt in seen:
                continue
            seen.add(prompt) if split == "preference_eval" else None
            if split == "preference_train" and prompt in {r["prompt"][0]["content"] for r in splits["preference_eval"]}:
                continue
            splits[split].append({
                "prompt": [{"role": "user", "content": prompt}],
                "chosen": [{"role": "assistant", "content": " ".join(reversed(seq))}],
                "rejected": [{"role": "assistant", "content": " ".join(wrong_answer(seq, rng))}],
            })
    for split, rows in splits.items():
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
    preference_pairs()
