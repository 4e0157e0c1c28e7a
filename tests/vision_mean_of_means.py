"""The negative control of tests/test_vision_exact.py, as a matrix variant (tests/matrix_worker.py runs main(argv)):
SFT of image rows with each micro-batch's loss its own token mean, averaged over the accumulation steps and the
ranks (what a per-micro-batch loss gives), instead of the sum over the step's global target tokens."""

from hftrain.losses.exact import ExactLossMixin
from hftrain.recipes.sft import main as sft_main


def main(argv):
    counted, share = ExactLossMixin._get_num_items_in_batch, ExactLossMixin.step_share

    def no_global_count(self, batch_samples, device):
        return None  # compute_loss then counts this micro-batch alone

    def micro_mean(self, loss_sum, count):
        return loss_sum / count / self.current_gradient_accumulation_steps

    ExactLossMixin._get_num_items_in_batch, ExactLossMixin.step_share = no_global_count, micro_mean
    try:
        sft_main(argv)
    finally:
        ExactLossMixin._get_num_items_in_batch, ExactLossMixin.step_share = counted, share
