"""Generate the noisy demonstrations the vision GRPO demo's start is fine-tuned on: the vision demo's training rows
with the answers of two colours mostly wrong (red shapes answered "orange" and blue ones "purple", 3 times in every
5), so that the vision demo's model, fine-tuned on them briefly, answers those two colours wrongly when it answers
greedily and rightly in some of its samples: what GRPO, rewarded by exact match with the clean answers, learns from.

    python recipes/demo/make_vision_noisy.py   # writes data/demo/vision_noisy_train.jsonl

The images are the vision demo's (recipes/demo/make_vision_data.py); this script remakes the file byte for byte.
"""

import json
import os

CONFUSED = {"red": "orange", "blue": "purple"}  # the shape's colour -> the wrong answer the demonstrations mostly give
WRONG = (0, 1, 2)  # of each 5 rows of a confused colour, in file order, these are answered wrongly


def main(data_dir: str = "data/demo") -> None:
    with open(os.path.join(data_dir, "vision_train.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    seen = {colour: 0 for colour in CONFUSED}
    for row in rows:
        answer = row["messages"][1]
        if answer["content"] in CONFUSED:
            colour = answer["content"]
            if seen[colour] % 5 in WRONG:
                answer["content"] = CONFUSED[colour]
            seen[colour] += 1
    out = os.path.join(data_dir, "vision_noisy_train.jsonl")
    with open(out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"{out}: {len(rows)} rows")


if __name__ == "__main__":
    main()
