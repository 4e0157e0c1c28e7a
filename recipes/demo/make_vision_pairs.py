"""Generate the vision DPO demo's pairs from the vision demo's rows: the same images and question, the shape's colour
as the chosen answer and another colour (seeded) as the rejected one.

    python recipes/demo/make_vision_pairs.py   # writes data/demo/vision_pairs_{train,eval}.jsonl

The images are the vision demo's (data/demo/vision/*.png, recipes/demo/make_vision_data.py); this script remakes the
two files byte for byte.
"""

import json
import os
import random

COLOURS = ("red", "green", "blue", "yellow", "purple", "orange")  # make_vision_data.py's


def pair(row: dict, rng: random.Random) -> dict:
    prompt, answer = row["messages"][0], row["messages"][1]["content"]
    return {"prompt": [prompt], "chosen": answer, "rejected": rng.choice([c for c in COLOURS if c != answer])}


def main(data_dir: str = "data/demo", seed: int = 0) -> None:
    rng = random.Random(seed)
    for split in ("train", "eval"):
        with open(os.path.join(data_dir, f"vision_{split}.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        out = os.path.join(data_dir, f"vision_pairs_{split}.jsonl")
        with open(out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(pair(row, rng)) + "\n" for row in rows)
        print(f"{out}: {len(rows)} pairs")


if __name__ == "__main__":
    main()
