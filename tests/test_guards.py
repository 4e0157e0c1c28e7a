"""Finite or stop, no non-finite weights saved, and the engine built is the strategy asked for (hftrain/guards.py).

Single-process runs go through recipes/sft.py's main() in this process (as test_bad_input does); the 2-rank runs
launch tests/guard_worker.py, which injects a NaN loss on one rank (a test-only hook, read from the environment)."""

import json
import math
import re
import os
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

from hftrain import guards
from hftrain.errors import LaunchError, NonFiniteError, exit_on_user_error
from hftrain.methods.sft import SFTTrainer

from . import guard_worker
from .conftest import ACCELERATE_LAUNCH, DEMO_TRAIN, run
from .support import free_port


def recipe(tmp_path, model_dir, **training) -> str:
    tree = {"model": {"name_or_path": model_dir, "dtype": "float32"},
            "data": {"sources": [{"path": DEMO_TRAIN}], "max_length": 32},
            "training": {"output_dir": str(tmp_path / "out"), "max_steps": 4, "per_device_train_batch_size": 4,
                         "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
                         "disable_tqdm": True, "seed": 0, "lr_scheduler_type": "constant", **training}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return str(path)


def run_main(argv, capsys) -> tuple[int, str]:
    try:
        with exit_on_user_error():
            guard_worker.sft.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def checkpoint_weights_finite(out) -> list[str]:
    """The checkpoints in out, each asserted finite."""
    found = sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")) if os.path.isdir(out) else []
    for name in found:
        for key, t in load_file(os.path.join(out, name, "model.safetensors")).items():
            assert torch.isfinite(t).all(), f"{name}/{key} holds non-finite values"
    return found


# -- finite or stop: real runs -------------------------------------------------------------------------------------
def test_a_diverging_run_stops_naming_the_step_and_saves_nothing_non_finite(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "out"
    code, err = run_main([recipe(tmp_path, tiny_model_dir, learning_rate=1e30, save_strategy="steps", save_steps=1)],
                         capsys)
    assert code == 2, err[-3000:]
    assert err.count("hftrain: error:") == 1 and "Traceback" not in err, err[-3000:]
    message = err[err.index("hftrain: error:"):]
    assert re.search(r"optimizer step 2: the (training loss on rank 0|gradient norm) is (nan|inf)", message), message
    for fix in ("lower training.learning_rate (now 1e+30)", "training.max_grad_norm", "check the data of optimizer "
                "step 2", "training.max_bad_steps (now 0)", "the update was not applied"):
        assert fix in message, message
    assert not os.path.exists(out / "model.safetensors")
    # Step 1's update (lr 1e30) is huge but finite and was checkpointed; step 2's would be inf: never applied.
    assert checkpoint_weights_finite(out) == ["checkpoint-1"]


def test_a_sane_run_is_not_stopped(tmp_path, tiny_model_dir, capsys):
    """Negative control: the same run at a sane learning rate trains to the end and saves."""
    code, err = run_main([recipe(tmp_path, tiny_model_dir, max_steps=2)], capsys)
    assert code == 0, err[-3000:]
    assert os.path.isfile(tmp_path / "out" / "model.safetensors")


def test_max_bad_steps_skips_the_step_without_touching_the_weights(tmp_path, tiny_model_dir, capsys, monkeypatch):
    digests = tmp_path / "digests.jsonl"
    monkeypatch.setattr(SFTTrainer, "_forward", guard_worker.forward)
    monkeypatch.setattr(SFTTrainer, "__init__", guard_worker.init)
    monkeypatch.setenv("HFTRAIN_TEST_NAN_STEPS", "2")
    monkeypatch.setenv("HFTRAIN_TEST_DIGESTS", str(digests))
    code, err = run_main([recipe(tmp_path, tiny_model_dir, max_bad_steps=1, weight_decay=0.1)], capsys)
    assert code == 0, err[-3000:]
    assert "optimizer step 2: the training loss on rank 0 is nan" in err and "the step is skipped" in err, err[-3000:]
    d = [json.loads(line)["digest"] for line in digests.read_text().splitlines()]
    assert len(d) == 5  # before training, then after steps 1..4
    assert d[2] == d[1], "the skipped step 2 changed the weights (momentum or weight decay applied)"
    assert len({d[0], d[1], d[3], d[4]}) == 4, "the steps around the skipped one must train"
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    logs = [h for h in state["log_history"] if "loss" in h]
    assert [h["bad_steps"] for h in logs] == [0, 1, 1, 1]
    assert state["global_step"] == 4  # a skipped step counts as a step (the LR schedule advances too)


def test_one_bad_step_more_than_allowed_stops(tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setattr(SFTTrainer, "_forward", guard_worker.forward)
    monkeypatch.setenv("HFTRAIN_TEST_NAN_STEPS", "2,3")
    code, err = run_main([recipe(tmp_path, tiny_model_dir, max_bad_steps=1)], capsys)
    assert code == 2, err[-3000:]
    message = err[err.index("hftrain: error:"):]
    assert "optimizer step 3: the training loss on rank 0 is nan" in message, message
    assert "(1 earlier bad step skipped)" in message and "training.max_bad_steps (now 1)" in message, message
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")


@pytest.mark.launches
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_nan_on_one_rank_ends_both_ranks_at_once(strategy, tmp_path, tiny_model_dir):
    exits = tmp_path / "exits"
    exits.mkdir()
    start = time.time()
    r = run([*ACCELERATE_LAUNCH, "--config_file", f"accelerate_configs/{strategy}.yaml", "--main_process_port",
             str(free_port()), "tests/guard_worker.py",
             recipe(tmp_path, tiny_model_dir, max_steps=20), f"strategy.name={strategy}"], timeout=300,
            env={"HFTRAIN_TEST_NAN_STEPS": "2", "HFTRAIN_TEST_NAN_RANK": "1", "HFTRAIN_TEST_EXIT_DIR": str(exits)},
            real=True)  # each rank must end by itself: tests/forked.py stops the others sooner than torchrun's agent
    elapsed = time.time() - start
    assert r.returncode != 0, r.stderr[-4000:]
    assert "hftrain: error: optimizer step 2: the training loss on rank 1 is nan" in r.stderr, r.stderr[-4000:]
    assert "the gradient norm is nan" in r.stderr  # the reduction spread rank 1's NaN gradients to rank 0
    ranks = {p.name: json.loads(p.read_text()) for p in exits.iterdir()}
    assert set(ranks) == {"rank0.json", "rank1.json"} and {v["code"] for v in ranks.values()} == {2}, ranks
    # neither waited on the other (a rank left waiting would hold on until strategy.rank_timeout, 300 s)
    assert abs(ranks["rank0.json"]["time"] - ranks["rank1.json"]["time"]) < 60, ranks
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")
    print(f"2-rank {strategy} NaN run ended in {elapsed:.0f} s (start-up included)")


@pytest.mark.launches
def test_a_nan_on_one_rank_is_skipped_alike_by_both_ranks(tmp_path, tiny_model_dir):
    """max_bad_steps under DDP with rank 1's loss NaN: both ranks skip the step (the verdict is gathered), train on,
    and end with equal weights (save_final's per-rank digest check) that the skipped step did not change."""
    digests = tmp_path / "digests.jsonl"
    r = run([*ACCELERATE_LAUNCH, "--config_file", "accelerate_configs/ddp.yaml", "--main_process_port",
             str(free_port()), "tests/guard_worker.py",
             recipe(tmp_path, tiny_model_dir, max_bad_steps=1)], timeout=300,
            env={"HFTRAIN_TEST_NAN_STEPS": "2", "HFTRAIN_TEST_NAN_RANK": "1", "HFTRAIN_TEST_DIGESTS": str(digests)})
    assert r.returncode == 0, r.stderr[-4000:]
    assert "optimizer step 2: the training loss on rank 1 is nan" in r.stderr and "the step is skipped" in r.stderr
    info = json.loads((tmp_path / "out" / "run_info.json").read_text())
    assert info["world_size"] == 2 and len(set(info["rank_weight_digests"])) == 1
    d = [json.loads(line)["digest"] for line in digests.read_text().splitlines()]
    assert len(d) == 5 and d[2] == d[1] and len({d[0], d[1], d[3], d[4]}) == 4
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert [h["bad_steps"] for h in state["log_history"] if "loss" in h] == [0, 1, 1, 1]


@pytest.mark.launches
def test_under_zero2_a_nan_loss_stops_before_the_engine_steps(tmp_path, tiny_model_dir, deepspeed_ops):
    """DeepSpeed steps inside backward: the loss is judged before the backward of the step's last micro-batch."""
    exits = tmp_path / "exits"
    exits.mkdir()
    r = run([*ACCELERATE_LAUNCH, "--config_file", "accelerate_configs/zero2.yaml", "--main_process_port",
             str(free_port()), "tests/guard_worker.py",
             recipe(tmp_path, tiny_model_dir, max_steps=20, gradient_accumulation_steps=2), "strategy.name=zero2"],
            timeout=300, env={"HFTRAIN_TEST_NAN_STEPS": "2", "HFTRAIN_TEST_NAN_RANK": "1",
                              "HFTRAIN_TEST_EXIT_DIR": str(exits)}, real=True)  # as above
    assert r.returncode != 0, r.stderr[-4000:]
    assert ("hftrain: error: optimizer step 2: the training loss on rank 1 is nan; the run stops, the update was "
            "not applied") in r.stderr, r.stderr[-4000:]
    assert {json.loads(p.read_text())["code"] for p in exits.iterdir()} == {2} and len(list(exits.iterdir())) == 2
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")


# -- finite or stop: the pieces ------------------------------------------------------------------------------------
def test_step_guard_verdicts():
    args = SimpleNamespace(learning_rate=1e-3, max_grad_norm=1.0)
    g = guards.StepGuard(max_bad_steps=0)
    g.add_loss(torch.tensor(2.0))
    assert g.verdict(torch.tensor(1.0), "cpu") == []
    assert g.decide([], 1, args, can_skip=True) is False
    g.add_loss(torch.tensor(1.0))
    assert g.verdict(torch.tensor(float("inf")), "cpu") == [("the gradient norm", float("inf"))]
    g.add_loss(torch.tensor(1.0))
    g.add_loss(torch.tensor(float("nan")))  # one micro-batch of the step
    bad = g.verdict(None, "cpu")
    assert [w for w, _ in bad] == ["the training loss on rank 0"]
    g.add_loss(torch.tensor(float("nan")))
    assert g.verdict(torch.tensor(float("nan")), "cpu", check_grad_norm=False)[-1][0] == "the training loss on rank 0"
    with pytest.raises(NonFiniteError, match="the run stops, the update was not applied"):
        guards.StepGuard(max_bad_steps=3).decide(bad, 7, args, can_skip=False)  # DeepSpeed: never skipped
    with pytest.raises(NonFiniteError, match="DeepSpeed's engine had already applied the update"):
        guards.StepGuard().decide([("the gradient norm", math.inf)], 7, args, can_skip=False, applied=True)
    g = guards.StepGuard(max_bad_steps=1)
    assert g.decide(bad, 5, args, can_skip=True) is True and g.bad_steps == 1
    with pytest.raises(NonFiniteError, match=r"optimizer step 6: .*\(1 earlier bad step skipped\)"):
        g.decide(bad, 6, args, can_skip=True)


def test_non_finite_weights_are_named():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    guards.check_finite_weights(model, "x")  # negative control: finite weights pass
    with torch.no_grad():
        model[1].bias[0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"refusing to save the final model: parameter 1\.bias holds NaN"):
        guards.check_finite_weights(model, "the final model")
    # A ZeRO-3 parameter is an empty placeholder; its partition (ds_tensor) is what this rank holds.
    part = torch.nn.Parameter(torch.empty(0))
    part.ds_tensor = torch.tensor([1.0, float("nan")])
    fake = SimpleNamespace(named_parameters=lambda: [("w", part)], modules=lambda: [])
    assert guards.nonfinite_parameters(fake) == ["w"]


def test_a_quantised_bases_packed_weights_are_not_read_as_numbers():
    """bitsandbytes' 4-bit weights stored as float32 (what FSDP needs to shard them) show packed bytes as floats, NaN
    patterns among them: not a diverged run (the FSDP QLoRA run refused its first checkpoint on them)."""
    class Linear4bit(torch.nn.Linear):  # bitsandbytes' class name, which is what the guard goes by
        pass

    model = torch.nn.Sequential(Linear4bit(2, 2), torch.nn.Linear(2, 2))
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    assert guards.nonfinite_parameters(model) == []
    with torch.no_grad():
        model[0].bias[0] = float("nan")  # the layer's bias is a number of its own: still checked
        model[1].weight[0, 0] = float("inf")
    assert guards.nonfinite_parameters(model) == ["0.bias", "1.weight"]


def test_checkpoint_and_final_save_refuse_non_finite_weights(tmp_path, tiny_model_dir):
    from hftrain.artifacts import save_final
    from hftrain.methods import load_recipe

    from .test_checkpoints import make_trainer

    out = tmp_path / "out"
    trainer = make_trainer(tiny_model_dir, out, max_steps=1)
    trainer.train()
    before = sorted(os.listdir(out))
    with torch.no_grad():
        next(trainer.model.parameters())[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="refusing to save checkpoint-1: parameter model.embed_tokens.weight"):
        trainer._save_checkpoint(trainer.model, None)
    r = load_recipe(None, raw={"model": {"name_or_path": tiny_model_dir}, "data": {"sources": [{"path": DEMO_TRAIN}]},
                               "training": {"output_dir": str(out)}})
    with pytest.raises(NonFiniteError, match="refusing to save the final model"):
        save_final(trainer, r, replace(r.strategy, name="ddp"), trainer.processing_class, {})
    assert sorted(os.listdir(out)) == before  # no checkpoint-1, no staging folder, no model


# -- the engine ----------------------------------------------------------------------------------------------------
class _Engine:
    """A stand-in for DeepSpeed's engine: the questions engine_built asks."""

    def __init__(self, stage, opt="none", param="none"):
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

        self.stage, self.opt, self.param = stage, OffloadDeviceEnum(opt), OffloadDeviceEnum(param)

    def zero_optimization_stage(self):
        return self.stage

    def zero_offload_optimizer(self):
        return SimpleNamespace(device=self.opt)

    def zero_offload_param(self):
        return SimpleNamespace(device=self.param)


def fake_trainer(wrapped, deepspeed=False):
    return SimpleNamespace(model_wrapped=wrapped, model=torch.nn.Linear(1, 1), is_deepspeed_enabled=deepspeed,
                           args=SimpleNamespace(world_size=2))


DDP = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)


@pytest.mark.parametrize("strategy, wrapped, deepspeed, ok", [
    ("ddp", DDP, False, True),
    ("zero2", _Engine(2), True, True),
    ("zero3_offload", _Engine(3, "cpu", "cpu"), True, True),
    ("zero_infinity", _Engine(3, "nvme", "nvme"), True, True),
    ("zero2", DDP, False, False),  # ACCELERATE_USE_CPU: DeepSpeed dropped, plain DDP built
    ("zero3", torch.nn.Linear(1, 1), False, False),
    ("zero3", _Engine(3, "cpu", "cpu"), True, False),  # offload not asked for
    ("zero1", _Engine(2), True, False),
    ("fsdp", DDP, False, False),
    ("ddp", _Engine(1), True, False),
])
def test_the_engine_built_is_compared_with_the_strategy(strategy, wrapped, deepspeed, ok, monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    trainer = fake_trainer(wrapped, deepspeed)
    if ok:
        guards.raise_engine_problem(strategy, trainer)
        return
    with pytest.raises(LaunchError, match=f"strategy.name is '{strategy}' but the Trainer built"):
        guards.raise_engine_problem(strategy, trainer)


def test_the_engine_mismatch_names_its_cause(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    with pytest.raises(LaunchError, match=r"'zero2' but the Trainer built plain DDP \(model wrapper "
                                          r"DistributedDataParallel\).*ACCELERATE_USE_CPU is set"):
        guards.raise_engine_problem("zero2", fake_trainer(DDP))
    assert guards.engine_problem("ddp", {"engine": "single", "zero_stage": None, "wrapper": "M"}, 1) is None
    assert "no distributed wrapper" in guards.engine_problem("ddp", {"engine": "single", "zero_stage": None,
                                                                     "wrapper": "M"}, 2)


def test_use_cpu_with_deepspeed_is_refused_early(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    assert guards.environment_engine_problem("zero2", accelerator=False) is None
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    for name in ("zero1", "zero2", "zero3", "zero3_offload", "zero_infinity"):
        assert "ACCELERATE_USE_CPU=True" in guards.environment_engine_problem(name, accelerator=False)
    assert guards.environment_engine_problem("ddp", accelerator=True) is None
    assert guards.environment_engine_problem("fsdp", accelerator=False) is None  # patches.accelerate restores it
    assert guards.environment_engine_problem("fsdp", accelerator=True) is not None
    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")
    assert guards.environment_engine_problem("zero3", accelerator=False) is None


def test_hftrain_check_refuses_use_cpu_with_a_deepspeed_strategy(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from hftrain.cli import main

    path = recipe(tmp_path, tiny_model_dir)
    tree = yaml.safe_load(open(path))
    tree["strategy"] = {"name": "zero2"}
    open(path, "w").write(yaml.safe_dump(tree))
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    with pytest.raises(SystemExit) as e:
        main(["check", path])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "strategy.name: 'zero2' cannot run with ACCELERATE_USE_CPU=true" in err, err


@pytest.mark.launches
@pytest.mark.parametrize("early", [True, False], ids=["preflight", "after_wrap"])
def test_use_cpu_launch_of_zero2_is_stopped(early, tmp_path, tiny_model_dir, deepspeed_ops):
    """The real launch the issue describes: ACCELERATE_USE_CPU=true with a ZeRO-2 accelerate config. Preflight
    refuses it; with that check switched off (guard_worker), the check after the wrap sees plain DDP."""
    env = {"ACCELERATE_USE_CPU": "true", **({} if early else {"HFTRAIN_TEST_NO_EARLY_ENGINE_CHECK": "1"})}
    r = run([*ACCELERATE_LAUNCH, "--config_file", "accelerate_configs/zero2.yaml", "--main_process_port",
             str(free_port()), "tests/guard_worker.py",
             recipe(tmp_path, tiny_model_dir, max_steps=2), "strategy.name=zero2"], timeout=300, env=env)
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-4000:]
    expected = ("strategy.name: 'zero2' cannot run with ACCELERATE_USE_CPU=true" if early else
                "strategy.name is 'zero2' but the Trainer built plain DDP (model wrapper DistributedDataParallel)")
    # the launcher prints its own ChildFailedError traceback; the workers end with the message alone
    assert expected in r.stderr and 'sft.py", line' not in r.stderr, r.stderr[-4000:]
    assert "ACCELERATE_USE_CPU" in r.stderr
    out = tmp_path / "out"
    assert not os.path.exists(out / "model.safetensors")
    assert early == (not out.exists())  # the early refusal writes nothing at all


def test_max_bad_steps_rules():
    from hftrain.methods import parse_recipe

    def problems(**training):
        raw = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d"}]}, "training": training}
        return parse_recipe(None, [], raw)[1]

    assert not [p for p in problems(max_bad_steps=3) if "max_bad_steps" in p]  # negative control
    assert any("training.max_bad_steps: cannot be used with training.fp16" in p
               for p in problems(max_bad_steps=1, fp16=True))
    assert any("training.max_bad_steps: cannot skip steps under 'zero3'" in p
               for p in parse_recipe(None, [], {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d"}]},
                                                "strategy": {"name": "zero3"},
                                                "training": {"max_bad_steps": 1}})[1])
