"""The negative control of tests/test_process_reward.py's exactness: `hftrain reward` (kind process) with the
per-micro-batch mean (each micro-batch's mean CE over its labelled steps, divided by the accumulation steps by the
Trainer: a mean of means), by switching off the process trainer's global step count for this variant only. A test
driver with recipe scripts' main(argv), run as a variant of tests/matrix_worker.py."""

from unittest import mock

from hftrain import lifecycle
from hftrain.methods.reward.process import StepMeanMixin


def main(argv: list[str]) -> None:
    with mock.patch.object(StepMeanMixin, "_get_num_items_in_batch", lambda self, batches, device: None), \
            mock.patch.object(StepMeanMixin, "loss_is_scaled_for_ga", None):
        lifecycle.run("reward", argv)
