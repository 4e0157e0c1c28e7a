"""The negative control of tests/test_distill.py, as a matrix variant (tests/matrix_worker.py runs main(argv)): the
distillation run with each micro-batch's loss its own token mean, averaged over the accumulation steps (what a
per-micro-batch loss gives), instead of the sum over the step's global completion tokens. The count is left out
below DistillTrainer (ExactLossMixin's), so on_policy still replaces the step's rows by the student's samples."""

from hftrain.losses.exact import ExactLossMixin
from hftrain.recipes.distill import main as distill_main
from tests.support import run_with_micro_batch_means


def main(argv):
    run_with_micro_batch_means(ExactLossMixin, distill_main, argv)
