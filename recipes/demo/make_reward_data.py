"""Generate the reward-model demo's pairs for the letter-reversal task (recipes/demo/reward.yaml).

    python recipes/demo/make_reward_data.py   # writes data/demo/reward_{train,eval}.jsonl (reads {train,eval}.jsonl)

Each row is {prompt: the task's user turn, chosen: the right reversal, rejected: a wrong one}. The wrong answers take
five kinds in turn, so that a model can tell them apart only by checking the answer against the prompt: the letters
as given (not reversed), two neighbours swapped, one letter dropped, one letter replaced by another, one letter
doubled; the training pairs add a sixth kind, one letter replaced by a copy of its neighbour ("j b c c" for
"j b c e"): the mistake GRPO drove the policy into when the reward model had not seen it (docs/reward.md, Demo).
The held-out pairs keep the five kinds, so their accuracy stays comparable with the earlier figures. Held-out
prompts appear in no other file of data/demo/; training prompts avoid the SFT/GRPO held-out prompts
(data/demo/eval.jsonl), so a reward model trained here has seen none of the answers GRPO is judged on.
"""

import json
import os
import random

LETTERS = "abcdefghij"
KINDS = ("echo", "swap", "drop", "replace", "double")
TRAIN_KINDS = (*KINDS, "copy")


def wrong_answer(seq: list[str], kind: str, rng: random.Random) -> list[str] | None:
    """The reversal of `seq` made wrong in the way `kind` says, or None where that kind leaves it right (a palindrome
    echoed, two equal neighbours swapped)."""
    rev = list(reversed(seq))
    if kind == "copy":
        i = rng.randrange(len(rev) - 1)
        return None if rev[i] == rev[i + 1] else rev[:i] + [rev[i + 1], rev[i + 1]] + rev[i + 2:]
    if kind == "echo":
        return None if seq == rev else list(seq)
    i = rng.randrange(len(rev) - 1) if kind == "swap" else rng.randrange(len(rev))
    if kind == "swap":
        return None if rev[i] == rev[i + 1] else rev[:i] + [rev[i + 1], rev[i]] + rev[i + 2:]
    if kind == "drop":
        return rev[:i] + rev[i + 1:]
    if kind == "replace":
        return rev[:i] + [rng.choice([c for c in LETTERS if c != rev[i]])] + rev[i + 1:]
    return rev[:i + 1] + rev[i:]  # double


def pair(seq: list[str], kind: str, rng: random.Random, kinds: tuple[str, ...] = KINDS) -> dict:
    """One pair; a kind that leaves the answer right gives way to the next kind of `kinds` that does not."""
    start = kinds.index(kind)
    for k in kinds[start:] + kinds[:start]:
        wrong = wrong_answer(seq, k, rng)
        if wrong is not None:
            break
    return {
        "prompt": [{"role": "user", "content": f"reverse: {' '.join(seq)}"}],
        "chosen": [{"role": "assistant", "content": " ".join(reversed(seq))}],
        "rejected": [{"role": "assistant", "content": " ".join(wrong)}],
    }


def task_prompts(out_dir: str, name: str) -> set[str]:
    with open(os.path.join(out_dir, name), encoding="utf-8") as fh:
        return {json.loads(line)["messages"][0]["content"] for line in fh}


def main(out_dir: str = "data/demo", n_train: int = 4000, n_eval: int = 200, seed: int = 2) -> None:
    rng = random.Random(seed)
    held_out = task_prompts(out_dir, "eval.jsonl")
    taken = held_out | task_prompts(out_dir, "train.jsonl")  # held-out reward pairs avoid every task prompt
    splits: dict[str, list[dict]] = {"reward_eval": [], "reward_train": []}
    for split, n in (("reward_eval", n_eval), ("reward_train", n_train)):
        rows = splits[split]
        while len(rows) < n:
            seq = [rng.choice(LETTERS) for _ in range(rng.randint(3, 6))]
            prompt = f"reverse: {' '.join(seq)}"
            if prompt in (taken if split == "reward_eval" else held_out):
                continue
            if split == "reward_eval":
                taken.add(prompt)
                held_out.add(prompt)  # training pairs avoid the held-out reward prompts too
            kinds = KINDS if split == "reward_eval" else TRAIN_KINDS
            rows.append(pair(seq, kinds[len(rows) % len(kinds)], rng, kinds))
    for split, rows in splits.items():
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
