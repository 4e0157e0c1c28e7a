"""Generate the vision demo's data: the colour of a drawn shape.

    python recipes/demo/make_vision_data.py   # writes data/demo/vision_{train,eval}.jsonl and data/demo/vision/*.png

Each image is 56 x 56 pixels (PIL only, seeded: the same files on every machine): a square, circle or triangle of one
of six colours, of a random size and place, on a white or light grey background. The question is always "what
colour is the shape?" and the answer one word (a single token of the demo's tokenizer), so the answer is fully
determined by the image and exact match can judge it; held-out images are drawn with their own random sizes and
places. The images are committed (a few hundred bytes each); this script remakes them byte for byte.
"""

import json
import os
import random

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220), "yellow": (240, 210, 20),
           "purple": (140, 40, 170), "orange": (245, 130, 20)}
SHAPES = ("square", "circle", "triangle")
BACKGROUNDS = ((255, 255, 255), (215, 215, 215))
SIZE = 56
QUESTION = "what colour is the shape?"


def draw(rng: random.Random, colour: str, shape: str) -> Image.Image:
    """One image: the shape in its colour, 18 to 40 pixels wide, somewhere on the background."""
    image = Image.new("RGB", (SIZE, SIZE), rng.choice(BACKGROUNDS))
    side = rng.randint(18, 40)
    x, y = rng.randint(0, SIZE - side), rng.randint(0, SIZE - side)
    box, fill = [x, y, x + side - 1, y + side - 1], COLOURS[colour]
    pen = ImageDraw.Draw(image)
    if shape == "square":
        pen.rectangle(box, fill=fill)
    elif shape == "circle":
        pen.ellipse(box, fill=fill)
    else:
        pen.polygon([(x, y + side - 1), (x + side - 1, y + side - 1), (x + side // 2, y)], fill=fill)
    return image


def row(image_name: str, colour: str) -> dict:
    return {"messages": [
        {"role": "user", "content": [{"type": "image", "image": image_name}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": colour},
    ]}


def main(out_dir: str = "data/demo", n_train: int = 360, n_eval: int = 60, seed: int = 0) -> None:
    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "vision"), exist_ok=True)
    for split, n in (("train", n_train), ("eval", n_eval)):
        rows = []
        for i in range(n):
            colour, shape = list(COLOURS)[i % len(COLOURS)], SHAPES[(i // len(COLOURS)) % len(SHAPES)]
            name = f"vision/{split}_{i:03d}.png"  # relative to the data file's folder, as hftrain reads it
            draw(rng, colour, shape).save(os.path.join(out_dir, name), optimize=True)
            rows.append(row(name, colour))
        rng.shuffle(rows)
        with open(os.path.join(out_dir, f"vision_{split}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{out_dir}/vision_{split}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main()
