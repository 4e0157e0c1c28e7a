"""The negative control of tests/test_reward.py's exactness: `hftrain reward` with TRL's own averaging (each
micro-batch's pair mean, divided by the accumulation steps by the Trainer: a mean of means), by switching off
losses.PairMeanMixin's global pair count for this variant only. A test driver with recipe scripts' main(argv), run
as a variant of tests/matrix_worker.py."""

from unittest import mock

from hftrain import lifecycle
from hftrain.losses import PairMeanMixin


def main(argv: list[str]) -> None:
    with mock.patch.object(PairMeanMixin, "_get_num_items_in_batch", lambda self, batches, device: None), \
            mock.patch.object(PairMeanMixin, "loss_is_scaled_for_ga", None):
        lifecycle.run("reward", argv)
