"""The negative control of tests/test_distill.py, as a matrix variant (tests/matrix_worker.py runs main(argv)): the
distillation run with each micro-batch's loss its own token mean, averaged over the accumulation steps (what a
per-micro-batch loss gives), instead of the sum over the step's global completion tokens."""

from hftrain.methods.distill.trainer import DistillTrainer
from hftrain.recipes.distill import main as distill_main


def main(argv):
    counted, share = DistillTrainer._get_num_items_in_batch, DistillTrainer.step_share

    def no_global_count(self, batch_samples, device):
        return None  # compute_loss then counts this micro-batch alone

    def micro_mean(self, loss_sum, count):
        return loss_sum / count / self.current_gradient_accumulation_steps

    DistillTrainer._get_num_items_in_batch, DistillTrainer.step_share = no_global_count, micro_mean
    try:
        distill_main(argv)
    finally:
        DistillTrainer._get_num_items_in_batch, DistillTrainer.step_share = counted, share
