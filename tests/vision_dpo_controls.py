"""The negative controls of tests/test_vision_dpo.py, as matrix variants (tests/matrix_worker.py runs main(argv)):

- `mean_of_means`: each micro-batch's pair mean averaged over the accumulation steps (TRL's own loss: the pairs of a
  short micro-batch weigh more), instead of the mean over the step's pairs (losses.PairMeanMixin);
- `images_swapped`: each row batched with the next row's images (a collator that lost the rows' order), so the
  bound is shown to see images reaching the wrong pair.
"""

import sys

from hftrain.losses import PairMeanMixin
from hftrain.recipes.dpo import main as dpo_main
from hftrain.methods.pairs import ImagePairs


def mean_of_means(argv):
    counted = PairMeanMixin._get_num_items_in_batch
    PairMeanMixin._get_num_items_in_batch = lambda self, batch_samples, device: None  # TRL's micro-batch mean
    try:
        dpo_main(argv)
    finally:
        PairMeanMixin._get_num_items_in_batch = counted


def images_swapped(argv):
    collate = ImagePairs.__call__

    def swapped(self, rows):
        images = [row["images"] for row in rows]
        return collate(self, [{**row, "images": images[(i + 1) % len(rows)]} for i, row in enumerate(rows)])

    ImagePairs.__call__ = swapped
    try:
        dpo_main(argv)
    finally:
        ImagePairs.__call__ = collate


def main(argv):
    {"mean_of_means": mean_of_means, "images_swapped": images_swapped}[argv[0]](argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
