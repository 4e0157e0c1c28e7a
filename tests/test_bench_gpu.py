"""bench/gpu.py must run unmodified when a GPU is lent (issue 42): its every part, in its CPU smoke form (--tiny:
a tiny model, a few steps), in this process. The GPU figures themselves are measured only on a GPU."""

import importlib.util
import json
import os

import torch

from tests.exactness import within

from .conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(REPO, "bench", "gpu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_bench_runs_every_part_and_writes_its_report(tmp_path, capsys):
    gpu = _bench()
    report = gpu.main(["--tiny", "--out", str(tmp_path / "report.json")])
    sides = report["throughput"]
    assert {"plain Trainer", "hftrain (defaults)", "hftrain kernels off"} <= set(sides)
    assert all(s["tokens_per_s"] > 0 and s["steps"] == 4 for s in sides.values())
    # training.loss_impl: fused is measured, asked for by its key, wherever it runs (CUDA, liger-kernel): never here
    fused = {"fused"} if gpu.fused_runs() else set()
    assert ("hftrain fused loss" in sides) == bool(fused)
    assert set(report["loss"]) == {1024, 2048}
    assert all(set(v) == {"logits", "chunked"} | fused for v in report["loss"].values())
    # the loss step runs in float32 on the CPU, in bfloat16 on a GPU (bench/gpu.py loss_step): a bound for each
    bound = ("bench_gpu.chunked_vs_logits.loss_cuda_bf16" if torch.cuda.is_available()
             else "bench_gpu.chunked_vs_logits.loss")
    for vocab, r in report["loss"].items():
        within(bound, r["chunked"]["loss"], r["logits"]["loss"], label=f"vocabulary {vocab}")
    out = capsys.readouterr().out
    assert "| plain Trainer |" in out and "| hftrain kernels off |" in out and "| 2048 |" in out
    # the device the bench ran on: this host's GPU where it has one (the smoke run then runs there), else the CPU
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no GPU)"
    assert json.load(open(tmp_path / "report.json"))["device"] == device


def test_the_fused_loss_side_is_asked_for_by_its_key(monkeypatch):
    """On a CUDA machine with liger-kernel the bench measures training.loss_impl: fused as its own side: the fused
    loss runs only where a recipe asks for it (issue #54), so the bench must ask."""
    gpu = _bench()
    asked = []
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu.fused_ce, "machine_problem", lambda device_type: None)
    assert gpu.fused_runs()
    monkeypatch.setattr(gpu, "hftrain_side", lambda *a: asked.append(a[4:]) or (lambda timer: None))
    monkeypatch.setattr(gpu, "plain_side", lambda *a: lambda timer: None)
    monkeypatch.setattr(gpu, "save_model", lambda shape, folder: folder)
    monkeypatch.setattr(gpu, "random_rows", lambda *a: None)
    monkeypatch.setattr(gpu.importlib.util, "find_spec", lambda name: None)  # no TRL side
    monkeypatch.setattr(gpu, "timed", lambda *a: {"tokens_per_s": 1.0, "step_s": 1.0, "peak_bytes": None})
    monkeypatch.setattr(gpu, "mfu", lambda *a: None)
    gpu.part_throughput(type("NS", (), {"tiny": True, "steps": 1, "warmup": 0, "batch": 1, "seq": 8})(), "/tmp",
                        gpu.TINY_SHAPE)
    assert ("training.loss_impl=fused",) in asked and () in asked  # the defaults side stays the chunked loss


def test_mfu_counts_six_n_and_causal_attention():
    gpu = _bench()
    n = gpu.matmul_params(gpu.SHAPE)  # TinyLlama-1.1B without its embedding: about 0.97e9
    assert 0.9e9 < n < 1.05e9
    # 49.3k tokens/s (hftrain's first GPU run) on a 989 TFLOP/s peak: about 35-36% (docs/benchmarks.md)
    flops = 6 * n + 6 * gpu.SHAPE["num_hidden_layers"] * gpu.SHAPE["hidden_size"] * 2048
    assert 0.33 < 49.3e3 * flops / 989e12 < 0.37
