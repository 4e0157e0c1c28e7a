"""The negative control of tests/test_vision_exact.py, as a matrix variant (tests/matrix_worker.py runs main(argv)):
SFT of image rows with each micro-batch's loss its own token mean, averaged over the accumulation steps and the
ranks (what a per-micro-batch loss gives), instead of the sum over the step's global target tokens."""

from hftrain.losses.exact import ExactLossMixin
from hftrain.recipes.sft import main as sft_main
from tests.support import run_with_micro_batch_means


def main(argv):
    run_with_micro_batch_means(ExactLossMixin, sft_main, argv)
