"""Gradient compression: the compressors' maths (single process), then every method on 2 CPU ranks."""

import json
import math
import os
import time

import pytest
import torch
import torch.distributed as dist

from hftrain import compression as comp
from hftrain.config import RecipeError
from hftrain.methods import load_recipe

from .conftest import DEMO_TRAIN, REPO, launch_prefix, run_matrix
from .exactness import within

BASE = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}}


# ---------------------------------------------------------------------------------------------------------------
# Single process: error bounds, error feedback, top-k, bytes.

@pytest.mark.parametrize("chunk", [0, 7, 2048])
def test_int8_error_is_at_most_half_a_step_of_its_chunk(chunk):
    torch.manual_seed(0)
    x = torch.randn(5000) * torch.logspace(-3, 2, 5000)  # magnitudes over 5 decades: chunking matters
    q, scales = comp.quantize_int8(x, chunk)
    assert q.dtype == torch.int8 and q.numel() == x.numel()
    assert scales.numel() == (1 if chunk == 0 else math.ceil(5000 / chunk))
    err = (x - comp.dequantize_int8(q, scales, chunk)).abs()
    per_elem_scale = scales.repeat_interleave(5000 if chunk == 0 else chunk)[:5000]
    assert torch.all(err <= per_elem_scale / 2 + 1e-7)
    if chunk == 7:  # finer scales: far smaller error than one scale for all
        q0, s0 = comp.quantize_int8(x, 0)
        assert err.mean() < (x - comp.dequantize_int8(q0, s0, 0)).abs().mean() / 10


def test_topk_keeps_the_k_largest_magnitudes():
    torch.manual_seed(1)
    x = torch.randn(1000)
    idx, vals = comp.topk_select(x, 0.013)
    assert idx.numel() == 13 and idx.dtype == torch.int32
    assert set(idx.tolist()) == set(torch.argsort(x.abs(), descending=True)[:13].tolist())
    assert torch.equal(vals, x[idx.long()])


class FakeBucket:
    """What DDP hands a hook: a flat buffer, its index, whether it is the step's last bucket."""

    def __init__(self, buf, index=0):
        self._buf, self._index = buf, index

    def buffer(self):
        return self._buf

    def index(self):
        return self._index

    def is_last(self):
        return True


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("method", ["int8", "topk"])
def test_error_feedback_carries_exactly_the_residual(one_rank_group, method):
    """With one rank the hook's result is what this rank sent; sent + new residual == gradient + old residual."""
    state = comp.HookState(method=method, world=1, topk_ratio=0.05, int8_chunk=64)
    torch.manual_seed(2)
    residual = torch.zeros(3000)
    for step in range(3):
        g = torch.randn(3000)
        want = g + residual
        sent = comp.ddp_hook(state, FakeBucket(g.clone())).wait()
        residual = state.residuals[0].clone()
        within("compression.error_feedback.sent_plus_residual", sent + residual, want, label=f"{method} step {step}")
        assert residual.abs().sum() > 0  # something was held back
        if method == "topk":  # 150 values sent, each in bf16: only its rounding error stays behind
            kept = sent != 0
            assert kept.sum() == 150 and torch.equal(sent[kept], want[kept].to(torch.bfloat16).float())
            assert torch.all(residual[kept].abs() <= want[kept].abs() * 2**-8)
    # Without error feedback nothing is carried.
    state = comp.HookState(method=method, world=1, error_feedback=False, topk_ratio=0.05)
    comp.ddp_hook(state, FakeBucket(torch.randn(3000))).wait()
    assert state.residuals == {}


@pytest.mark.parametrize("method,size,ratio", [("int8", 3001, 0.01), ("topk", 3000, 0.011)])
def test_payload_rows_decode_at_any_size(one_rank_group, monkeypatch, method, size, ratio):
    """Gathered rows sit back to back: with an odd bucket (int8) or an odd k (top-k: 6 bytes per kept value) a
    second rank's row once started off 4-byte alignment and its int32/float32 fields could not be viewed (seen:
    an abort at step 10 of bench/compression.py). Two identical "ranks" must decode to the one-rank result."""
    g = torch.randn(size, generator=torch.Generator().manual_seed(5))
    one = comp.ddp_hook(comp.HookState(method=method, world=1, topk_ratio=ratio, int8_chunk=64,
                                       error_feedback=False), FakeBucket(g.clone())).wait()

    def two_rank_gather(out, payload, group=None, async_op=False):
        out.copy_(torch.cat([payload, payload]))
        fut = torch.futures.Future()
        fut.set_result([out])
        return type("Work", (), {"get_future": lambda self: fut})()

    monkeypatch.setattr(torch.distributed, "all_gather_single", two_rank_gather)
    two = comp.ddp_hook(comp.HookState(method=method, world=2, topk_ratio=ratio, int8_chunk=64,
                                       error_feedback=False), FakeBucket(g.clone())).wait()
    assert torch.equal(two, one) and one.abs().sum() > 0


def test_wire_bytes_and_time_share(monkeypatch):
    assert comp.wire_bytes("all_reduce", 1000, 2) == 1000 and comp.wire_bytes("all_reduce", 1000, 8) == 1750
    assert comp.wire_bytes("all_gather", 1000, 2) == 1000 and comp.wire_bytes("all_gather", 1000, 8) == 7000
    # Time share: the union of in-flight intervals, not their sum.
    m = comp.CommMeter()
    t0 = 100.0
    a, b = m.record(1, 1, start=t0 + 1), m.record(1, 1, start=t0 + 2)
    a[1], b[1] = t0 + 4, t0 + 3  # [1,4] and [2,3] overlap: 3 s busy
    monkeypatch.setattr(time, "perf_counter", lambda: t0 + 10)  # the step ends 10 s after it began
    stats = m.step_end(t0)
    assert stats["time_share"] == pytest.approx(0.3) and stats["bytes_raw"] == 2
    assert stats["seconds"] == pytest.approx(3) and stats["hidden_share"] == 0  # no backward end marked: none hidden


def test_interval_maths():
    assert comp.merge([(3, 4), (1, 2), (1.5, 2.5), (5, 5)]) == [(1, 2.5), (3, 4)]
    assert comp.length([(1, 3), (2, 4), (6, 7)]) == 4
    assert comp.minus([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert comp.minus([(0, 2), (4, 6)], [(1, 5)]) == [(0, 1), (5, 6)]
    assert comp.minus([(0, 2)], []) == [(0, 2)]


def test_hidden_share_is_the_flight_before_the_backward_ends_outside_the_hooks(monkeypatch):
    """Two buckets: the first all-reduce flies [1, 4] while the backward computes (hidden); the last bucket's hook is
    entered at 5 (the backward's compute is done), blocks until 6 and its collective flies [5.5, 9]: exposed. A
    blocking hook's own flight (PowerSGD on gloo) hides nothing even before the mark."""
    m = comp.CommMeter()
    t0 = 100.0
    first = m.record(1, 1, start=t0 + 1)
    m.hook_call(t0 + 0.9, t0 + 1.0, last_bucket=False)
    blocked = m.record(1, 1, start=t0 + 2)  # a hook that waits for its collective: [2, 3] inside the hook
    m.hook_call(t0 + 2, t0 + 3, last_bucket=False)
    last = m.record(1, 1, start=t0 + 5.5)
    m.hook_call(t0 + 5, t0 + 6, last_bucket=True)
    first[1], blocked[1], last[1] = t0 + 4, t0 + 3, t0 + 9
    monkeypatch.setattr(time, "perf_counter", lambda: t0 + 10)
    stats = m.step_end(t0)
    assert stats["seconds"] == pytest.approx(3 + 3.5)  # [1, 4] and [5.5, 9]
    assert stats["hidden_share"] == pytest.approx((1 + 1) / 6.5)  # [1, 2] and [3, 4]; [2, 3] was inside a hook
    assert m.step_end(t0 + 10)["seconds"] == 0  # reset per step


# ---------------------------------------------------------------------------------------------------------------
# Recipe rules: nothing accepted and ignored, impossible combinations refused before launch.

def test_options_that_do_not_apply_are_errors():
    with pytest.raises(RecipeError) as e:
        load_recipe(None, raw={**BASE, "compression": {"method": "int8", "topk_ratio": 0.1, "powersgd_rank": 2}})
    assert "compression.topk_ratio: applies to method topk, not 'int8'" in str(e.value)
    assert "compression.powersgd_rank" in str(e.value)
    with pytest.raises(RecipeError) as e:
        load_recipe(None, raw={**BASE, "compression": {"method": "powersgd", "start_step": 1}})
    assert "must be >= 2 for powersgd" in str(e.value)
    with pytest.raises(RecipeError) as e:
        load_recipe(None, raw={**BASE, "compression": {"method": "topk", "topk_ratio": 0}})
    assert "must be in (0, 1]" in str(e.value)
    r = load_recipe(None, raw={**BASE, "compression": {"method": "powersgd"}})
    assert r.compression.resolved_start_step() == 2 and r.compression.resolved_powersgd_rank() == 4


@pytest.mark.parametrize("method,strategy,overrides,message", [
    ("powersgd", "zero3", [], "'powersgd' runs only as a DDP communication hook, not under 'zero3'"),
    ("int8", "fsdp", [], "use strategy ddp, or compression.method fp16/bf16"),
    ("powersgd", "ddp", ["training.ddp_find_unused_parameters=true"], "races DDP's unused-parameter all-reduce"),
    ("none", "fsdp", ["compression.profile=true"], "compression.profile: times DDP's gradient all-reduce"),
])
def test_impossible_combinations_are_refused_before_launch(tmp_path, tiny_model_dir, method, strategy, overrides,
                                                           message, capsys, in_process):
    from hftrain.cli import main

    with pytest.raises(SystemExit) as e:
        main(["launch", os.path.join(REPO, "recipes/demo/sft.yaml"), "--dry-run",
              f"model.name_or_path={tiny_model_dir}", f"training.output_dir={tmp_path / 'o'}",
              f"compression.method={method}", f"strategy.name={strategy}", *overrides])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_zero_and_fsdp_get_the_reduction_dtype():
    from hftrain.config import StrategySection
    from hftrain.launch.strategies import deepspeed_config

    r = load_recipe(None, raw={**BASE, "compression": {"method": "bf16"}})
    assert r.compression.reduce_dtype() == "bf16"
    assert deepspeed_config(StrategySection(name="zero2"), "bf16")["communication_data_type"] == "bf16"
    assert "communication_data_type" not in deepspeed_config(StrategySection(name="zero2"))
    assert comp.fsdp_reduce_dtype(r.compression) == torch.bfloat16


# ---------------------------------------------------------------------------------------------------------------
# 2 CPU ranks, each method: no hang, equal weights after every step, loss falls, logged bytes == bytes sent.

def variant(tmp_path, tiny_model_dir, overrides, name) -> tuple[str, list[str]]:
    """tests/compression_worker.py on the demo recipe, writing tmp_path/NAME.json."""
    return "tests.compression_worker", [
        os.path.join(REPO, "recipes/demo/sft.yaml"), str(tmp_path / f"{name}.json"),
        f"model.name_or_path={tiny_model_dir}", f"data.sources.0.path={DEMO_TRAIN}", "data.eval_sources=[]",
        "training.eval_strategy=no", "eval.exact_match=0", f"training.output_dir={tmp_path / name}",
        "training.max_steps=8", "training.per_device_train_batch_size=8", "training.learning_rate=3e-3",
        "training.warmup_steps=0", "training.logging_steps=1", "training.save_strategy=no",
        "training.report_to=none", *overrides]


def launch_matrix(tmp_path, config, variants: dict) -> dict:
    """Every variant {name: (module, argv)} in one 2-rank launch under accelerate_configs/CONFIG.yaml."""
    return run_matrix(launch_prefix(2, config), variants, tmp_path / "matrix", ranks=2, timeout=600)


def result(tmp_path, variants, name) -> dict:
    variants[name].check()
    return json.load(open(tmp_path / f"{name}.json"))


DDP_METHODS = {
    "fp16": ("fp16", []), "bf16": ("bf16", []), "powersgd": ("powersgd", ["compression.powersgd_rank=2"]),
    "int8": ("int8", []), "topk": ("topk", ["compression.topk_ratio=0.05"]),
    # Our hooks issue one collective from the hook itself, so DDP's unused-parameter all-reduce cannot race them.
    "int8_unused": ("int8", ["training.ddp_find_unused_parameters=true"]),
    "none": ("none", ["compression.profile=true"]),  # DDP's plain all-reduce, timed in hftrain's hook
}
OTHER_STRATEGIES = {"fsdp": ("fsdp_reduce_dtype", "torch.bfloat16"), "zero2": ("communication_dtype", "torch.bfloat16")}


@pytest.fixture(scope="module")
def ddp_methods(tmp_path_factory, tiny_model_dir):
    """Every DDP method on 2 ranks, in one launch: (folder, {name: variant})."""
    tmp = tmp_path_factory.mktemp("ddp_methods")
    variants = {name: variant(tmp, tiny_model_dir, [f"compression.method={method}", *extra], name)
                for name, (method, extra) in DDP_METHODS.items()}
    return tmp, launch_matrix(tmp, "ddp", variants)


@pytest.mark.launches
@pytest.mark.parametrize("name", DDP_METHODS)
def test_ddp_method_on_two_ranks(ddp_methods, name):
    method = DDP_METHODS[name][0]
    res = result(*ddp_methods, name)
    assert res["world_size"] == 2 and res["wrapper"] == "DistributedDataParallel"
    steps = res["steps"]
    assert len(steps) == 8 and all(s["ranks_equal"] for s in steps), steps
    logs = [h for h in res["log_history"] if "loss" in h]
    assert logs[-1]["loss"] < logs[0]["loss"]
    # Logged bytes (per step, world 2: wire bytes == each rank's payload) equal what the collectives carried.
    for s, h in zip(steps, logs):
        assert h["comm/bytes_sent"] == pytest.approx(s["counted_bytes"], rel=1e-9), (s, h)
        assert h["comm/compression_ratio"] == pytest.approx(h["comm/bytes_raw"] / h["comm/bytes_sent"])
        assert 0 <= h["comm/time_share"] <= 1 and 0 <= h["comm/hidden_share"] <= 1 and h["comm/seconds"] > 0
    ratio = logs[-1]["comm/compression_ratio"]
    expected = {"none": (1, 1), "fp16": (2, 2), "bf16": (2, 2), "powersgd": (4, 100), "int8": (3.9, 4),
                "topk": (13.2, 13.34)}[method]
    assert expected[0] <= ratio <= expected[1], ratio
    if method == "powersgd":  # vanilla all-reduce for the first start_step (2) steps
        assert logs[0]["comm/compression_ratio"] == 1 and logs[2]["comm/compression_ratio"] > 4


@pytest.mark.launches
@pytest.mark.parametrize("strategy", OTHER_STRATEGIES)
def test_bf16_reduction_under_fsdp_and_zero(tmp_path, tiny_model_dir, deepspeed_ops, strategy):
    field, value = OTHER_STRATEGIES[strategy]
    variants = {strategy: variant(tmp_path, tiny_model_dir, ["compression.method=bf16", f"strategy.name={strategy}"],
                                  strategy)}
    res = result(tmp_path, launch_matrix(tmp_path, strategy, variants), strategy)
    assert res["world_size"] == 2 and res[field] == value
    logs = [h for h in res["log_history"] if "loss" in h]
    assert logs[-1]["loss"] < logs[0]["loss"] and logs[0]["comm/compression_ratio"] == 2
