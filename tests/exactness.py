"""Exactness bounds, each measured: what a comparison allows, and the largest error seen on each CPU path.

An exactness test compares two computations that are equal in exact arithmetic (2 ranks against 1, a resumed run
against an uninterrupted one, a fused loss against plain PyTorch). Their float32 results differ by rounding, and by
how much depends on the kernels' reduction order, which ATen picks by the CPU's vector width
(ATEN_CPU_CAPABILITY: avx512, avx2, default): a bound that held on one machine kind failed on another (issue 70).

So every bound is named here with the largest relative error observed under each capability it was measured on
(`scripts/exactness_spread.py` runs the tests that use bounds under each capability this CPU has, with
HFTRAIN_SPREAD_LOG set, and tabulates what `within` and `beyond` recorded). The rule for a limit:
  - at least MARGIN x the largest error seen on any path, rounded up to 1, 2 or 5 (another machine's path may be
    several times worse: the Mixtral ZeRO-3 weights differ by 1.45e-5 on AVX-512, 2.2e-6 on AVX2, 6.3e-6 on the
    default path), and never under FLOOR (a few float32 roundings of a value near 1);
  - below every control's error (`beyond`: the same comparison with a real fault planted, a per-micro-batch mean or
    a wrong scale) by MARGIN, so the bound still catches a fault of that size.
tests/test_exactness.py holds the table to that rule.

Errors are relative, one number per comparison, in float64: the largest |a - b| over the largest |b| of a number, a list
of numbers or a tensor (dicts and lists of tensors key by key, item by item, the largest of those).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import torch

MARGIN = 10.0
FLOOR = 1e-6
SPREAD_LOG = "HFTRAIN_SPREAD_LOG"  # a JSON-lines file: each judged error is appended to it
# Set (scripts/exactness_spread.py --record-only): errors are recorded and not judged, for a bound being measured.
RECORD_ONLY = "HFTRAIN_SPREAD_RECORD_ONLY"


@dataclasses.dataclass(frozen=True)
class Bound:
    limit: float
    seen: dict  # CPU capability (avx512, avx2, default) -> the largest relative error seen there
    note: str = ""  # why the limit is what it is, where the rule alone does not say


# name -> Bound(limit, the largest relative error seen per CPU path, note). `seen`: `scripts/exactness_spread.py
# --record-only` on an AMD EPYC with AVX2 (no AVX-512: its avx2 and default paths), 2026-12-02, commit 89d0bfc of
# the tests (issue 65's bounds: 2026-12-06); avx512: the same on an Intel Xeon with AVX-512, 2026-12-06 (605 tests,
# 12.5 min), the larger kept where another AVX-512 machine reported one (Mixtral's 1.45e-5). The limit: the rule in
# the docstring (10x the largest seen, at least 1e-6, rounded up to 1, 2 or 5); nine limits were raised by the avx512
# figures (MoE aux weights, the ZeRO-3 QLoRA adapter, a process reward model's eval loss among them).
BOUNDS: dict[str, Bound] = {
    "bench_gpu.chunked_vs_logits.loss": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0},
        "bench/gpu.py on the CPU; on a GPU bf16 (loss_cuda_bf16, not measured)"),
    # bench/gpu.py's bf16 run on a GPU: the old bound, never measured (no GPU was lent to the session that measured)
    "bench_gpu.chunked_vs_logits.loss_cuda_bf16": Bound(1e-05, {}, "GPU only: not measured"),
    "checkpoints.resume_vs_uninterrupted.weights": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "chunked_loss.autocast_bf16.loss": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0},
        "under bfloat16 autocast"),
    "chunked_loss.bf16.grads": Bound(1e-01, {"avx512": 0.00559, "avx2": 0.00559, "default": 0.00559},
        "bfloat16 gradients: 8 bits of mantissa"),
    "chunked_loss.bf16.loss": Bound(1e-06, {"avx512": 0, "avx2": 9.76e-08, "default": 0.0},
        "bfloat16 logits"),
    "chunked_loss.eval_sums_vs_logits": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "chunked_loss.example_sums_vs_logits": Bound(1e-06, {"avx512": 0, "avx2": 3.02e-08, "default": 2.01e-08}),
    "chunked_loss.head_maths.grads": Bound(5e-06, {"avx512": 2.06e-07, "avx2": 2.06e-07, "default": 2.06e-07}),
    "chunked_loss.head_maths.loss": Bound(2e-06, {"avx512": 1.59e-07, "avx2": 1.59e-07, "default": 9.24e-08}),
    "chunked_loss.trainer_step.grads": Bound(2e-05, {"avx512": 1.22e-06, "avx2": 1.07e-06, "default": 1.38e-06}),
    "chunked_loss.trainer_step.loss": Bound(2e-06, {"avx512": 1.53e-07, "avx2": 1.52e-07, "default": 1.53e-07}),
    "chunked_loss.vs_logits.grads": Bound(5e-06, {"avx512": 2.6e-07, "avx2": 2.89e-07, "default": 2.89e-07}),
    "chunked_loss.vs_logits.loss": Bound(2e-06, {"avx512": 1.26e-07, "avx2": 1.26e-07, "default": 1.26e-07}),
    "compile.compiled_vs_eager.losses": Bound(1e-06, {"avx512": 8.48e-08, "avx2": 8.48e-08, "default": 8.48e-08}),
    "compile.compiled_vs_eager.weights": Bound(5e-04, {"avx512": 4.72e-06, "avx2": 2.3e-06, "default": 2.52e-05}),
    "compression.error_feedback.sent_plus_residual": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "data.joined_vs_rows.logits": Bound(5e-06, {"avx512": 2.21e-07, "avx2": 2.21e-07, "default": 1.47e-07}),
    "data.packed_vs_alone.logits": Bound(5e-06, {"avx512": 1.51e-07, "avx2": 2.29e-07, "default": 1.69e-07}),
    "distill.divergence.chunked_vs_unchunked.grads": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "distill.divergence.chunked_vs_unchunked.value": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "distill.divergence.per_token_vs_formula": Bound(5e-06,
        {"avx512": 5.43e-10, "avx2": 3.16e-07, "default": 5.43e-10}),
    "distill.divergence.to_itself_is_zero": Bound(1e-06, {"avx512": 6.66e-09, "avx2": 1.06e-08, "default": 2.66e-08}),
    "distill.divergence.top_k_vs_formula": Bound(1e-06, {"avx512": 7.34e-08, "avx2": 7.34e-08, "default": 7.34e-08}),
    "distill.divergence.vs_formula.grads": Bound(2e-05, {"avx512": 1.8e-06, "avx2": 1.84e-06, "default": 1.86e-06}),
    "distill.divergence.vs_formula.value": Bound(2e-06, {"avx512": 9.95e-08, "avx2": 1.23e-07, "default": 1.23e-07}),
    "distill.lmbda.two_ranks_vs_one.losses": Bound(2e-06, {"avx512": 1.29e-07, "avx2": 0.0, "default": 6.45e-08}),
    "distill.lmbda.two_ranks_vs_one.weights": Bound(2e-06, {"avx512": 1.19e-07, "avx2": 1.19e-07, "default": 1.18e-07}),
    "distill.on_policy.resumed_vs_uninterrupted.losses": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "distill.on_policy.resumed_vs_uninterrupted.weights": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "distill.on_policy.two_ranks_vs_one.losses": Bound(2e-06,
        {"avx512": 1.29e-07, "avx2": 1.94e-07, "default": 6.46e-08}),
    "distill.on_policy.two_ranks_vs_one.weights": Bound(2e-06,
        {"avx512": 1.18e-07, "avx2": 1.55e-07, "default": 1.81e-07}),
    "distill.one_batch_vs_accumulated.losses": Bound(2e-06,
        {"avx512": 6.65e-08, "avx2": 6.65e-08, "default": 1.33e-07}),
    "distill.one_batch_vs_accumulated.weights": Bound(5e-06,
        {"avx512": 2.72e-07, "avx2": 2.59e-07, "default": 2.2e-07}),
    "distill.packed_vs_padded.losses": Bound(2e-06, {"avx512": 0, "avx2": 0.0, "default": 1.25e-07}),
    "distill.packed_vs_padded.weights": Bound(5e-06, {"avx512": 1.56e-07, "avx2": 2.24e-07, "default": 4.15e-07}),
    "distill.trainer_loss.copy_is_zero": Bound(1e-06, {"avx512": 5.42e-08, "avx2": 5.87e-08, "default": 6.87e-08}),
    "distill.trainer_loss.vs_by_hand": Bound(2e-05, {"avx512": 1.07e-06, "avx2": 1.19e-06, "default": 1.1e-06}),
    "distill.two_ranks_vs_one.losses": Bound(2e-06, {"avx512": 6.65e-08, "avx2": 1.33e-07, "default": 6.65e-08}),
    "distill.two_ranks_vs_one.weights": Bound(5e-06, {"avx512": 2.2e-07, "avx2": 4.14e-07, "default": 3.82e-07}),
    "e2e.lora_merged_vs_adapted.logits": Bound(1e-05, {"avx512": 2.33e-07, "avx2": 5.23e-07, "default": 2.33e-07}),
    "eval.eval_loss_vs_token_mean.loss": Bound(1e-06, {"avx512": 1.63e-08, "avx2": 5.32e-08, "default": 2.94e-08}),
    "eval.example_sums_vs_loss_sum.loss": Bound(1e-06, {"avx512": 6.65e-08, "avx2": 5.17e-08, "default": 4.81e-08}),
    "eval.packed_vs_padded.example_sums": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "eval.processes_vs_one_process.loss": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "fused_loss.sum_vs_chunked.grads": Bound(2e-06, {"avx512": 1.73e-07, "avx2": 1.73e-07, "default": 1.73e-07}),
    "fused_loss.sum_vs_chunked.sum": Bound(1e-06, {"avx512": 6.32e-08, "avx2": 6.32e-08, "default": 6.32e-08}),
    "fused_loss.vs_chunked.grads": Bound(2e-05, {"avx512": 1.22e-06, "avx2": 7.09e-07, "default": 1.38e-06}),
    "fused_loss.vs_chunked.loss": Bound(5e-06, {"avx512": 2.29e-07, "avx2": 1.52e-07, "default": 2.29e-07},
        "on the CPU: liger's stand-in (tests/test_fused_loss.py), not the GPU kernel"),
    "grpo.two_ranks_vs_one.weights": Bound(1e-05, {"avx512": 5.53e-07, "avx2": 6.76e-07, "default": 4.4e-07}),
    "grpo_process_reward.batched_vs_alone.scores": Bound(1e-06,
        {"avx512": 5.96e-08, "avx2": 2.98e-08, "default": 5.96e-08}),
    "grpo_reward_model.left_padded_vs_alone.scores": Bound(1e-06,
        {"avx512": 1.49e-08, "avx2": 1.49e-08, "default": 3.35e-08}),
    "grpo_reward_model.logged_reward_vs_weighted_sum.reward": Bound(1e-06,
        {"avx512": 2.98e-08, "avx2": 2.98e-08, "default": 1.49e-08}),
    "grpo_reward_model.scorer_vs_alone.scores": Bound(1e-06,
        {"avx512": 1.49e-08, "avx2": 1.49e-08, "default": 3.35e-08}),
    "hub.pushed_vs_run.probe_logits": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "kto.loss_vs_formula.loss": Bound(1e-05, {"avx512": 4.96e-07, "avx2": 6.58e-07, "default": 1.51e-07}),
    "kto.step_kl_vs_formula.z": Bound(1e-04, {"avx512": 5.01e-06, "avx2": 8.52e-06, "default": 4.01e-06}),
    "loss.aux_term_ranks_x_accumulation_vs_mean.grad": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "loss.first_step_vs_pytorch.loss": Bound(2e-06, {"avx512": 1.37e-07, "avx2": 1.37e-07, "default": 6.98e-08}),
    "loss.first_step_vs_pytorch.weights": Bound(1e-05, {"avx512": 4.66e-07, "avx2": 7.76e-07, "default": 2.59e-07}),
    "loss.layouts_vs_one_rank_ga4.losses": Bound(5e-06, {"avx512": 2.06e-07, "avx2": 3.49e-07, "default": 1.4e-07}),
    "loss.layouts_vs_one_rank_ga4.weights": Bound(5e-05, {"avx512": 3.92e-06, "avx2": 3.04e-06, "default": 1.66e-06}),
    "loss.packed_vs_padded.loss": Bound(2e-06, {"avx512": 1.24e-07, "avx2": 1.24e-07, "default": 0.0}),
    "loss.sequence_loss_vs_row_means.loss": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "loss.token_loss_vs_transformers.loss": Bound(2e-06, {"avx512": 8.17e-08, "avx2": 1.63e-07, "default": 1.63e-07}),
    "moe.aux_ddp_vs_one_rank.losses": Bound(2e-06, {"avx512": 1.25e-07, "avx2": 0.0, "default": 6.27e-08}),
    "moe.aux_ddp_vs_one_rank.weights": Bound(1e-04, {"avx512": 5.65e-06, "avx2": 9.97e-07, "default": 1.98e-06}),
    "moe.bias_ddp_vs_one_rank.losses": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 8.44e-08}),
    "mesh.hsdp_vs_one_rank.heldout_logits": Bound(1e-04, {"avx512": 6.97e-06, "avx2": 5.35e-06, "default": 6.14e-06}),
    "mesh.hsdp_vs_one_rank.losses": Bound(2e-06, {"avx512": 6.65e-08, "avx2": 6.65e-08, "default": 1.33e-07}),
    "mesh.hsdp_vs_one_rank.weights": Bound(1e-05, {"avx512": 4.08e-07, "avx2": 4.14e-07, "default": 8.15e-07}),
    "mesh.hsdp.resumed_vs_uninterrupted.losses": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "mesh.hsdp.resumed_vs_uninterrupted.weights": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "mesh.tp_vs_one_rank.heldout_logits": Bound(5e-04, {"avx512": 2.66e-05, "avx2": 1.49e-05, "default": 1.53e-05}),
    "mesh.tp_vs_one_rank.losses": Bound(2e-06, {"avx512": 2e-07, "avx2": 1.33e-07, "default": 2e-07}),
    "mesh.tp_vs_one_rank.weights": Bound(5e-05, {"avx512": 3.62e-06, "avx2": 4.86e-06, "default": 3.42e-06}),
    "moe.bias_ddp_vs_one_rank.weights": Bound(1e-05, {"avx512": 5.68e-07, "avx2": 2e-07, "default": 4.06e-07}),
    "moe.ep_clip_vs_one_rank.grad_norms": Bound(1e-05, {"avx512": 1.65e-07, "avx2": 9.92e-07, "default": 4.96e-07}),
    "moe.ep_clip_vs_one_rank.losses": Bound(2e-06, {"avx512": 6.27e-08, "avx2": 1.25e-07, "default": 6.27e-08}),
    "moe.ep_clip_vs_one_rank.weights": Bound(5e-05, {"avx512": 2.57e-06, "avx2": 4.19e-06, "default": 4.99e-06}),
    "moe.ep_ddp_vs_one_rank.losses": Bound(2e-06, {"avx512": 6.27e-08, "avx2": 6.27e-08, "default": 1.25e-07}),
    "moe.ep_ddp_vs_one_rank.weights": Bound(5e-05, {"avx512": 1.36e-06, "avx2": 1.15e-06, "default": 3.17e-06}),
    "moe.ep_fsdp_resume_vs_uninterrupted.losses": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "moe.ep_fsdp_resume_vs_uninterrupted.weights": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "moe.ep_fsdp_saved_vs_run.probe_logits": Bound(5e-06, {"avx512": 3.59e-07, "avx2": 3.9e-07, "default": 4.29e-07}),
    "moe.ep_fsdp_vs_one_rank.grad_norms": Bound(1e-05, {"avx512": 1.65e-07, "avx2": 6.06e-07, "default": 3.86e-07}),
    "moe.ep_fsdp_vs_one_rank.losses": Bound(1e-06, {"avx512": 6.27e-08, "avx2": 6.27e-08, "default": 6.27e-08}),
    "moe.ep_fsdp_vs_one_rank.weights": Bound(1e-04, {"avx512": 2.57e-06, "avx2": 1.68e-06, "default": 5.77e-06}),
    "moe.ep_layer_vs_native.grad_experts": Bound(1e-06, {"avx512": 6.53e-08, "avx2": 9.25e-08, "default": 6.61e-08}),
    "moe.ep_layer_vs_native.grad_input": Bound(5e-06, {"avx512": 0, "avx2": 3.1e-07, "default": 2.79e-07}),
    "moe.ep_layer_vs_native.grad_router": Bound(1e-04, {"avx512": 0, "avx2": 7.51e-06, "default": 2.26e-06}),
    "moe.ep_layer_vs_native.logits": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "moe.ep_layer_vs_native.out": Bound(5e-06, {"avx512": 0, "avx2": 2.29e-07, "default": 2.29e-07}),
    "moe.ep_resume_vs_uninterrupted.losses": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "moe.ep_resume_vs_uninterrupted.weights": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "moe.ep_scaled_grad_vs_reference.experts": Bound(2e-06,
        {"avx512": 1.02e-07, "avx2": 1.02e-07, "default": 1.02e-07}),
    "moe.family_ddp_vs_one_rank.losses": Bound(2e-06, {"avx512": 1.29e-07, "avx2": 1.74e-07, "default": 1.16e-07}),
    "moe.family_ddp_vs_one_rank.weights": Bound(2e-05, {"avx512": 7.82e-07, "avx2": 8.78e-07, "default": 1.17e-06}),
    "moe.lora_merged_vs_adapted.logits": Bound(5e-05, {"avx512": 3.14e-06, "avx2": 2.13e-06, "default": 2.07e-06}),
    "moe.resume_vs_uninterrupted.losses": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "moe.resume_vs_uninterrupted.weights": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "moe.trainer_loss_vs_formula.loss": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "moe.upcycled_vs_dense.logits": Bound(5e-06, {"avx512": 4.74e-07, "avx2": 4.2e-07, "default": 3.84e-07}),
    "moe.zero3_saved_vs_run.probe_logits": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "moe.zero3_vs_one_rank.biases": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "moe.zero3_vs_one_rank.losses": Bound(5e-06, {"avx512": 1.88e-07, "avx2": 1.88e-07, "default": 2.01e-07}),
    "moe.zero3_vs_one_rank.weights": Bound(2e-04, {"avx512": 1.45e-05, "avx2": 2.2e-06, "default": 6.32e-06},
        "avx512: the Mixtral run of issue 70 (1.4498e-5). Rounding, amplified by lr 0.5 over 3 SGD steps: each "
        "float32 run is 8.6e-6 to 1.1e-5 from the float64 result (1.7e-7 at lr 0.05), and in float64 2 ranks "
        "equal 1 to 3.5e-16"),
    "moe_balance.bias_update_vs_rule.biases": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "orpo.loss_vs_formula.loss": Bound(1e-06, {"avx512": 2.11e-08, "avx2": 2.34e-08, "default": 8.29e-08}),
    "preference.ga4_vs_one_batch.losses": Bound(5e-06, {"avx512": 2.58e-07, "avx2": 3.87e-07, "default": 2.15e-07}),
    "preference.ga4_vs_one_batch.weights": Bound(5e-05, {"avx512": 1.52e-06, "avx2": 2.2e-06, "default": 6.46e-07}),
    "preference.precomputed_vs_frozen_copy.losses": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "preference.precomputed_vs_frozen_copy.weights": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "preference.simpo_vs_formula.loss": Bound(1e-05, {"avx512": 5.69e-07, "avx2": 5.69e-07, "default": 1.14e-07}),
    "preference.two_ranks_vs_one.losses": Bound(1e-05, {"avx512": 9.87e-07, "avx2": 5.59e-07, "default": 3.87e-07}),
    "preference.two_ranks_vs_one.weights": Bound(5e-05, {"avx512": 1.57e-06, "avx2": 3.46e-06, "default": 1.52e-06}),
    "preference.unequal_micro_batches_vs_one_batch.loss": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "preference.unequal_micro_batches_vs_one_batch.weights": Bound(5e-06,
        {"avx512": 2.8e-07, "avx2": 1.77e-07, "default": 2.06e-07}),
    "process_reward.accumulated_vs_one_batch.loss": Bound(2e-06, {"avx512": 0, "avx2": 1.05e-07, "default": 1.05e-07}),
    "process_reward.accumulated_vs_one_batch.weights": Bound(2e-06,
        {"avx512": 1.13e-07, "avx2": 1.16e-07, "default": 6.12e-08}),
    "process_reward.eval_vs_by_hand.loss": Bound(1e-04, {"avx512": 6.7e-06, "avx2": 4.11e-06, "default": 9.21e-08}),
    "process_reward.resumed_vs_uninterrupted.losses": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "process_reward.resumed_vs_uninterrupted.weights": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "process_reward.two_ranks_vs_one.losses": Bound(2e-06, {"avx512": 1.43e-07, "avx2": 1.43e-07, "default": 7.16e-08}),
    "process_reward.two_ranks_vs_one.weights": Bound(1e-05,
        {"avx512": 4.96e-07, "avx2": 3.96e-07, "default": 7.93e-07}),
    "quantization.first_loss_vs_value_at_reference.loss": Bound(1e-06,
        {"avx512": 2.75e-09, "avx2": 2.75e-09, "default": 2.75e-09}),
    "quantization.int8_merged_vs_dequantised_lora.logits": Bound(5e-06,
        {"avx512": 3.76e-07, "avx2": 3.29e-07, "default": 3.36e-07}),
    "quantization.int8_vs_dequantised_lora.loss": Bound(5e-04,
        {"avx512": 2.46e-06, "avx2": 2.49e-05, "default": 2.47e-05},
        "LLM.int8 quantises activations too: not rounding alone"),
    "quantization.merged_vs_qlora.logits": Bound(1e-05, {"avx512": 4.27e-07, "avx2": 7.15e-07, "default": 7.54e-07}),
    "quantization.qlora_vs_dequantised_lora.grads": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "quantization.qlora_vs_dequantised_lora.loss": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "quantization.resumed_vs_uninterrupted.loss": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "quantization.resumed_vs_uninterrupted.weights": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "quantization.two_ranks_vs_one.losses": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "quantization.two_ranks_vs_one.weights": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "quantization.zero3_two_ranks_vs_one.weights": Bound(5e-04,
        {"avx512": 4.53e-05, "avx2": 2.3e-06, "default": 7.58e-06},
        "ZeRO-3's reduction order carried through Adam; an AVX-512 machine once showed 7e-5 elementwise"),
    "resume.killed_vs_uninterrupted.weights": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "resume.other_world_size.weights": Bound(2e-06, {"avx512": 1e-07, "avx2": 1.18e-07, "default": 9.41e-08}),
    "reward.accumulated_vs_one_batch.loss": Bound(2e-06, {"avx512": 0, "avx2": 0.0, "default": 1.19e-07}),
    "reward.accumulated_vs_one_batch.weights": Bound(2e-06, {"avx512": 1.28e-07, "avx2": 1.13e-07, "default": 1e-07}),
    "reward.lora_two_ranks_vs_one.losses": Bound(5e-06, {"avx512": 1.64e-07, "avx2": 1.64e-07, "default": 2.46e-07}),
    "reward.lora_two_ranks_vs_one.weights": Bound(2e-05, {"avx512": 1.13e-06, "avx2": 1.05e-06, "default": 1.3e-06}),
    "reward.padded_batch_vs_alone.scores": Bound(5e-06, {"avx512": 7.98e-08, "avx2": 2.66e-07, "default": 1.2e-07}),
    "reward.resumed_vs_uninterrupted.losses": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "reward.resumed_vs_uninterrupted.weights": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "reward.two_ranks_vs_one.losses": Bound(2e-06, {"avx512": 1.91e-07, "avx2": 9.56e-08, "default": 9.56e-08}),
    "reward.two_ranks_vs_one.weights": Bound(2e-05, {"avx512": 6.21e-07, "avx2": 4.27e-07, "default": 1.91e-06}),
    "sequence_parallel.chunked_slices_vs_rows.loss_sum": Bound(1e-06,
        {"avx512": 9.91e-08, "avx2": 9.91e-08, "default": 0.0}),
    "sequence_parallel.document_attention_vs_packed_mask.logits": Bound(2e-06,
        {"avx512": 1.24e-07, "avx2": 8.3e-08, "default": 1.04e-07}),
    "sequence_parallel.eval_dispatch_vs_packed_mask.logits": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "sequence_parallel.resume_vs_uninterrupted.losses": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "sequence_parallel.resume_vs_uninterrupted.weights": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "sequence_parallel.slices_vs_rows.loss_sum": Bound(2e-06,
        {"avx512": 9.91e-08, "avx2": 9.91e-08, "default": 1.65e-07}),
    "sequence_parallel.unpatched_vs_doubled_step.weights": Bound(1e-05,
        {"avx512": 2.6e-07, "avx2": 6.49e-07, "default": 3.46e-07}),
    "sequence_parallel.vs_one_process.eval_losses": Bound(5e-06,
        {"avx512": 3.21e-07, "avx2": 2.7e-07, "default": 3.07e-07}),
    "sequence_parallel.vs_one_process.losses": Bound(5e-06, {"avx512": 2.07e-07, "avx2": 6.9e-08, "default": 1.37e-07}),
    "sequence_parallel.vs_one_process.weights": Bound(1e-04,
        {"avx512": 4.8e-06, "avx2": 6.61e-06, "default": 3.82e-06}),
    "strategies.initial_eval_vs_one_process.loss": Bound(1e-06,
        {"avx512": 2.8e-09, "avx2": 7.79e-11, "default": 1.87e-09}),
    "strategies.nvme_vs_cpu_offload.losses": Bound(1e-06, {"avx512": 8.57e-08, "avx2": 0.0, "default": 0.0}),
    "strategies.saved_vs_run.probe_logits": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "strategies.vs_ddp.final_eval_loss": Bound(5e-06, {"avx512": 2.48e-07, "avx2": 2.46e-07, "default": 2.49e-07}),
    "strategies.vs_ddp.losses": Bound(5e-06, {"avx512": 3.4e-07, "avx2": 3.4e-07, "default": 3.4e-07}),
    "stream.resume_vs_uninterrupted.losses": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "stream.resume_vs_uninterrupted.weights": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0}),
    "vision.lora_merged_vs_adapted.logits": Bound(5e-06, {"avx512": 1.98e-07, "avx2": 2.97e-07, "default": 1.98e-07}),
    "vision.packed_vs_accumulated.eval_loss": Bound(5e-6, {"avx512": 1.79e-7, "avx2": 2.81e-7, "default": 1.16e-7}),
    "vision.packed_vs_accumulated.losses": Bound(5e-6, {"avx512": 1.68e-7, "avx2": 2.51e-7, "default": 1.68e-7}),
    "vision.packed_vs_accumulated.weights": Bound(2e-5, {"avx512": 9.89e-7, "avx2": 1.11e-6, "default": 1.17e-6}),
    "vision.lora_two_ranks_vs_one.losses": Bound(1e-6, {"avx512": 8.42e-8, "avx2": 8.42e-8, "default": 0}),
    "vision.lora_two_ranks_vs_one.weights": Bound(5e-6, {"avx512": 2.05e-7, "avx2": 2.05e-7, "default": 1.82e-7}),
    "vision.part_rates.weights": Bound(1e-5, {"avx512": 5.93e-7, "avx2": 5.93e-7, "default": 5.93e-7}),
    "vision.moe_two_ranks_vs_one.losses": Bound(1e-6, {"avx512": 0, "avx2": 8.27e-8, "default": 0}),
    "vision.moe_two_ranks_vs_one.weights": Bound(5e-6, {"avx512": 2.71e-7, "avx2": 2.94e-7, "default": 3.19e-7}),
    "vision.packed_vs_padded.example_losses": Bound(1e-6, {"avx512": 0, "avx2": 6.86e-9, "default": 1.37e-8}),
    "vision.packed_vs_padded.loss": Bound(1e-6, {"avx512": 2.77e-9, "avx2": 5.56e-9, "default": 5.55e-9}),
    "vision.padded_batch_vs_alone.logits": Bound(5e-06, {"avx512": 3.48e-07, "avx2": 1.3e-07, "default": 3.04e-07}),
    "vision.resumed_vs_uninterrupted.losses": Bound(1e-6, {"avx512": 0, "avx2": 0, "default": 0}),
    "vision.resumed_vs_uninterrupted.weights": Bound(1e-6, {"avx512": 0, "avx2": 0, "default": 0}),
    "vision.two_ranks_packed_vs_one.eval_loss": Bound(5e-6, {"avx512": 3.45e-7, "avx2": 3.34e-7, "default": 3.13e-7}),
    "vision.two_ranks_packed_vs_one.losses": Bound(2e-6, {"avx512": 8.41e-8, "avx2": 8.41e-8, "default": 1.7e-7}),
    "vision.two_ranks_packed_vs_one.weights": Bound(2e-5, {"avx512": 1.3e-6, "avx2": 1.1e-6, "default": 9.6e-7}),
    "vision.two_ranks_vs_one.eval_loss": Bound(5e-6, {"avx512": 2.26e-7, "avx2": 2.42e-7, "default": 2.19e-7}),
    "vision.two_ranks_vs_one.losses": Bound(1e-6, {"avx512": 8.5e-8, "avx2": 8.5e-8, "default": 8.5e-8}),
    "vision.two_ranks_vs_one.saved_logits": Bound(2e-5, {"avx512": 9.64e-7, "avx2": 1.16e-6, "default": 1.22e-6}),
    "vision.two_ranks_vs_one.weights": Bound(2e-5, {"avx512": 1.02e-6, "avx2": 1.6e-6, "default": 9.48e-7}),
    # measured 2026-12-06 (issue 65's VLM DPO), same machine and method
    "vision_dpo.two_ranks_vs_one.losses": Bound(5e-06, {"avx512": 1.9e-07, "avx2": 2.8e-07, "default": 1.9e-07}),
    "vision_dpo.two_ranks_vs_one.weights": Bound(5e-05, {"avx512": 2.57e-06, "avx2": 1.38e-06, "default": 2.16e-06}),
    "vision_dpo.unequal_micro_batches_vs_one_batch.losses": Bound(1e-06, {"avx512": 0, "avx2": 0.0, "default": 0.0},
        "one step: both runs log the first step's loss, log 2 (policy = reference); the weights judge it"),
    "vision_grpo.two_ranks_vs_one.weights": Bound(1e-05, {"avx512": 8.89e-07, "avx2": 6.1e-07, "default": 8.49e-07}),
    "vision_dpo.unequal_micro_batches_vs_one_batch.weights": Bound(1e-05,
        {"avx512": 4.25e-07, "avx2": 4.21e-07, "default": 5.03e-07}),
}


def _judged() -> bool:
    return os.environ.get(RECORD_ONLY) != "1"


def bound(name: str) -> Bound:
    if name not in BOUNDS and not _judged():
        return Bound(math.inf, {}, "being measured")
    if name not in BOUNDS:
        raise KeyError(f"exactness bound {name!r} is not in tests/exactness.py BOUNDS: add it with its measured spread")
    return BOUNDS[name]


def _pairs(got, want):
    """(where, got, want) for each comparison: a dict key by key, a list of tensors or dicts item by item; a number,
    a list of numbers or a tensor is one comparison."""
    if isinstance(want, dict):
        if set(got) != set(want):
            raise AssertionError(f"different keys: {sorted(set(got) ^ set(want))[:10]}")
        for k in want:
            yield from ((f"{k}{sub}", g, w) for sub, g, w in _pairs(got[k], want[k]))
    elif isinstance(want, (list, tuple)) and want and isinstance(want[0], (torch.Tensor, dict, list, tuple)):
        if len(got) != len(want):
            raise AssertionError(f"lengths differ: {len(got)} against {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            yield from ((f"[{i}]{sub}", gg, ww) for sub, gg, ww in _pairs(g, w))
    else:
        yield "", got, want


def _relative(got, want, scale: float = 0.0) -> float:
    g = torch.as_tensor(got, dtype=torch.float64)
    w = torch.as_tensor(want, dtype=torch.float64)
    if g.shape != w.shape:
        raise AssertionError(f"shapes differ: {tuple(g.shape)} against {tuple(w.shape)}")
    if g.numel() == 0:
        return 0.0
    difference = (g - w).abs().max()
    if not math.isfinite(float(difference)):
        return math.inf
    scale = max(float(w.abs().max()), scale)
    return float(difference) / scale if scale > 0 else float(difference)


def relative_error(got, want, scale: float = 0.0) -> tuple[float, str]:
    """The largest relative difference of `got` from `want`, and where it is (a key, an index). `scale`: the least
    magnitude a difference is measured against, for values that may be near zero (a reward, a margin)."""
    worst, where = 0.0, ""
    for at, g, w in _pairs(got, want):
        err = _relative(g, w, scale)
        if err > worst or (math.isinf(err) and not math.isinf(worst)):
            worst, where = err, at
    return worst, where


def _record(name: str, error: float, control: bool) -> None:
    path = os.environ.get(SPREAD_LOG)
    if not path:
        return
    entry = {"bound": name, "error": error, "control": control,
             "capability": torch.backends.cpu.get_cpu_capability().lower(),
             "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]}
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")


def within(name: str, got, want, label: str = "", scale: float = 0.0) -> float:
    """Assert that `got` equals `want` within bound `name`; the error is recorded for the spread table."""
    b = bound(name)
    error, where = relative_error(got, want, scale)
    _record(name, error, control=False)
    told = f"{label + ': ' if label else ''}{name}"
    assert error <= b.limit or not _judged(), (f"{told}: relative error {error:.3g} at {where or 'the value'} over its "
                                               f"bound {b.limit:g} (seen: {b.seen})")
    return error


def beyond(name: str, got, want, label: str = "", scale: float = 0.0) -> float:
    """The control: `got`, computed with a fault planted, differs from `want` by more than bound `name` allows, so the
    bound would catch that fault."""
    b = bound(name)
    error, _ = relative_error(got, want, scale)
    _record(name, error, control=True)
    told = f"{label + ': ' if label else ''}{name}"
    assert error > MARGIN * b.limit or not _judged(), (f"{told}: the control differs by only {error:.3g}, less than "
                                                       f"{MARGIN:g} x the bound {b.limit:g}: the bound barely sees "
                                                       "this fault")
    return error
