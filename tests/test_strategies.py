"""Strategies: generated configs (golden + drift), option errors, and each strategy really running on 2 ranks."""

import filecmp
import json
import os
import re
import socket

import pytest
import torch
import yaml

from hftrain.config import strategy_of_deepspeed_config
from hftrain.config import RecipeError, StrategySection
from hftrain.methods import load_recipe
from hftrain.constants import STRATEGIES
from hftrain.launch.strategies import accelerate_config, deepspeed_config, render
from tests.exactness import within
from tests.references import STEPS
from tests.support import free_port

from .conftest import ACCELERATE_LAUNCH, DEMO_EVAL, DEMO_TRAIN, PY, REPO, eval_token_mean, run

SHIPPED = os.path.join(REPO, "accelerate_configs")


def test_shipped_configs_equal_the_generator_output(tmp_path):
    """accelerate_configs/ is generated: regenerate every strategy and compare byte for byte."""
    for name in STRATEGIES:
        render(StrategySection(name=name), str(tmp_path), json_dir="accelerate_configs")
    generated = sorted(os.listdir(tmp_path))
    assert generated == sorted(f for f in os.listdir(SHIPPED) if f.endswith((".yaml", ".json")))
    _, mismatch, errors = filecmp.cmpfiles(tmp_path, SHIPPED, generated, shallow=False)
    assert not mismatch and not errors, (f"regenerate with `hftrain config --all --output accelerate_configs`: "
                                         f"{mismatch}")


def test_deepspeed_values_owned_by_training_arguments_are_auto():
    for name in ("zero1", "zero2", "zero3", "zero3_offload", "zero_infinity"):
        cfg = deepspeed_config(StrategySection(name=name))
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                    "gradient_clipping"):
            assert cfg[key] == "auto"
        assert cfg["bf16"] == {"enabled": "auto"} and cfg["fp16"] == {"enabled": "auto"}
        assert strategy_of_deepspeed_config(cfg) == name  # the launcher's JSON is classified back to the same name


def test_zero3_golden_and_infinity_traps():
    z3 = deepspeed_config(StrategySection(name="zero3"))["zero_optimization"]
    assert z3["stage"] == 3 and z3["stage3_gather_16bit_weights_on_model_save"] is True
    inf = deepspeed_config(StrategySection(name="zero_infinity", nvme_path="/mnt/nvme", aio_queue_depth=16))
    zero = inf["zero_optimization"]
    assert zero["offload_param"]["device"] == "nvme" and zero["offload_param"]["nvme_path"] == "/mnt/nvme"
    assert zero["offload_optimizer"]["device"] == "nvme"
    assert zero["stage3_prefetch_bucket_size"] == 0 and zero["stage3_max_reuse_distance"] == 0
    assert "aio" not in zero and inf["aio"]["queue_depth"] == 16 and inf["aio"]["block_size"] == 1048576
    off = deepspeed_config(StrategySection(name="zero3_offload"))
    assert off["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert off["optimizer"]["params"]["lr"] == "auto"
    assert deepspeed_config(StrategySection(name="ddp")) is None


def test_accelerate_config_shapes():
    fsdp = accelerate_config(StrategySection(name="fsdp", fsdp_offload_params=True))
    assert fsdp["distributed_type"] == "FSDP" and fsdp["fsdp_config"]["fsdp_version"] == 2
    assert fsdp["fsdp_config"]["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp["fsdp_config"]  # found from the model
    assert fsdp["fsdp_config"]["fsdp_offload_params"] is True
    multi = accelerate_config(StrategySection(name="zero2", num_machines=2, num_processes=16,
                                              main_process_ip="10.0.0.1", machine_rank=1), "z.json")
    assert multi["num_machines"] == 2 and multi["machine_rank"] == 1 and multi["main_process_ip"] == "10.0.0.1"
    assert multi["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"
    assert "mixed_precision" not in multi  # accelerate refuses it beside a DeepSpeed JSON


def test_options_for_another_strategy_are_errors():
    with pytest.raises(RecipeError) as e:
        load_recipe(None, ["model.name_or_path=m", "data.sources.0.path=d", "strategy.name=zero2",
                           "strategy.nvme_path=/x", "strategy.fsdp_offload_params=true"], raw={})
    assert "strategy.nvme_path: does not apply to strategy 'zero2' (it applies to zero_infinity)" in str(e.value)
    assert "strategy.fsdp_offload_params: does not apply to strategy 'zero2' (it applies to fsdp)" in str(e.value)


def test_cli_config_for_a_recipe_writes_its_strategy(tmp_path, capsys):
    from hftrain.cli import main

    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump({"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d"}]},
                                   "strategy": {"name": "zero_infinity", "nvme_path": "/scratch"},
                                   "training": {"bf16": True}}))
    assert main(["config", str(rec), "--output", str(tmp_path / "out"), "strategy.buffer_count=7"]) == 0
    assert "wrote" in capsys.readouterr().out
    ds = json.load(open(tmp_path / "out" / "zero_infinity.json"))
    assert ds["zero_optimization"]["offload_param"]["nvme_path"] == "/scratch"
    assert ds["zero_optimization"]["offload_param"]["buffer_count"] == 7
    acc = yaml.safe_load(open(tmp_path / "out" / "zero_infinity.yaml"))
    assert acc["deepspeed_config"]["deepspeed_config_file"] == str(tmp_path / "out" / "zero_infinity.json")


# ---------------------------------------------------------------------------------------------------------------
# Each strategy on 2 CPU ranks with the shipped config.

ENGINES = {
    "ddp": {"wrapper": "DistributedDataParallel"},
    "fsdp": {"distributed_type": "DistributedType.FSDP"},
    "zero1": {"wrapper": "DeepSpeedEngine", "zero_stage": 1, "offload_param": "none"},
    "zero2": {"wrapper": "DeepSpeedEngine", "zero_stage": 2, "offload_optimizer": "none"},
    # fp32 weights are the master copy (deepspeed_fixes.share_fp32_master_with_fp32_weights: 4 bytes/param/N less)
    "zero3": {"wrapper": "DeepSpeedEngine", "zero_stage": 3, "offload_param": "none", "fp32_master": "the weights"},
    "zero3_offload": {"wrapper": "DeepSpeedEngine", "zero_stage": 3, "offload_param": "cpu",
                      "offload_optimizer": "cpu", "fp32_master": "a copy"},
}


@pytest.fixture(scope="module")
def strategy_runs(reference_runs):
    """Each strategy's 2-rank reference run (tests/references.py: the shipped config, 6 steps, eval and exact match),
    shared with test_resume and test_e2e."""
    return {name: reference_runs(name) for name in ENGINES}


@pytest.mark.launches
@pytest.mark.parametrize("name", list(ENGINES))
def test_strategy_runs_with_the_right_engine_and_saves_a_loadable_model(strategy_runs, name):
    from transformers import AutoModelForCausalLM

    from hftrain.constants import PROBE_IDS

    od = strategy_runs[name]
    info = json.load(open(od / "run_info.json"))
    assert info["world_size"] == 2 and info["launcher_world_size"] == 2 and info["strategy"] == name
    for key, value in ENGINES[name].items():
        assert info[key] == value, (key, info)
    if name == "fsdp":
        assert info["fsdp2_modules"] >= 3  # the model and its decoder layers are sharded units
    # The generated configs of the run sit beside the model.
    assert os.path.isfile(od / f"{name}.yaml")
    model = AutoModelForCausalLM.from_pretrained(str(od), dtype=torch.float32).eval()
    ids = torch.tensor(PROBE_IDS) % model.config.vocab_size
    with torch.no_grad():
        within("strategies.saved_vs_run.probe_logits", model(input_ids=ids).logits,
               torch.tensor(info["probe_logits"]), label=name)


@pytest.mark.launches
def test_loss_trajectories_agree_across_strategies(strategy_runs):
    def losses(name):
        state = json.load(open(strategy_runs[name] / "trainer_state.json"))
        return [h["loss"] for h in state["log_history"] if "loss" in h]

    ref = losses("ddp")
    assert len(ref) == STEPS
    for name in ENGINES:
        within("strategies.vs_ddp.losses", losses(name), ref, label=name)


@pytest.mark.launches
def test_eval_agrees_across_strategies(strategy_runs, reference_runs):
    """The demo's 200 held-out examples on 2 ranks x 64 leave a last round of 72: the sampler's repeats must not
    count. Before training every strategy holds the same weights; after 6 steps they agree (bound
    strategies.vs_ddp.final_eval_loss)."""
    metrics = {name: json.load(open(strategy_runs[name] / "run_info.json"))["metrics"] for name in ENGINES}
    initial = eval_token_mean(reference_runs.model_dir, DEMO_EVAL)
    for name, m in metrics.items():
        within("strategies.initial_eval_vs_one_process.loss", m["initial_eval_loss"], initial, label=name)
        within("strategies.vs_ddp.final_eval_loss", m["final_eval_loss"], metrics["ddp"]["final_eval_loss"], label=name)
        assert 0 <= m["final_exact_match"] <= 1
        if "initial_exact_match" in m:  # not under ZeRO-3 (recipes/sft.py)
            assert m["initial_exact_match"] == metrics["ddp"]["initial_exact_match"], name


def test_strategy_mismatch_with_launcher_stops_before_loading(tmp_path, tiny_model_dir, capsys, in_process):
    """recipes/sft.py's main(argv) in this process (no launcher: what the launcher set up reads as 'ddp')."""
    from hftrain.recipes.sft import main

    with pytest.raises(SystemExit) as e:
        main([os.path.join(REPO, "recipes/demo/sft.yaml"), "strategy.name=zero3",
              f"model.name_or_path={tiny_model_dir}", f"training.output_dir={tmp_path / 'o'}"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "strategy.name is 'zero3' but the launcher set up 'ddp'" in err
    assert "--config_file accelerate_configs/zero3.yaml" in err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------------------------
# Preflight, launch, multi-node


def test_preflight_nvme_path_problems(tmp_path):
    from hftrain.launch.machine import nvme_problems

    assert "does not exist" in nvme_problems(str(tmp_path / "missing"))[0]
    f = tmp_path / "file"
    f.write_text("x")
    assert "is not a folder" in nvme_problems(str(f))[0]
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.geteuid() != 0:  # root writes anywhere; the permission check is then exercised by the space check
            assert "is not writable" in nvme_problems(str(ro))[0]
    finally:
        ro.chmod(0o700)
    assert "GiB free but the swap needs about" in nvme_problems(str(tmp_path), need_bytes=2**60)[0]
    assert nvme_problems(str(tmp_path), need_bytes=1) == []


@pytest.mark.launches
def test_preflight_runs_before_model_load_and_lists_everything(tmp_path, tiny_model_dir):
    r = run([*ACCELERATE_LAUNCH, "--config_file", "accelerate_configs/zero_infinity.yaml", "--main_process_port",
             str(free_port()), "recipes/sft.py", os.path.join(REPO, "recipes/demo/sft.yaml"),
             f"model.name_or_path={tiny_model_dir}", f"training.output_dir={tmp_path / 'o'}",
             f"strategy.nvme_path={tmp_path / 'no_such_dir'}", "training.optim=sgd"], timeout=120)
    assert r.returncode != 0
    assert r.stderr.count("hftrain: error:") == 1 and "problems in the recipe:" in r.stderr
    assert "strategy.nvme_path: " in r.stderr and "does not exist" in r.stderr
    assert "training.optim: 'sgd' cannot be used with 'zero_infinity'" in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.launches
def test_launch_renders_configs_and_runs(tmp_path, tiny_model_dir):
    out = tmp_path / "o"
    r = run([PY, "-m", "hftrain.cli", "launch", os.path.join(REPO, "recipes/demo/sft.yaml"),
             f"model.name_or_path={tiny_model_dir}", f"training.output_dir={out}", "training.max_steps=2",
             "eval.exact_match=0", "training.report_to=none", f"strategy.main_process_port={free_port()}"], real=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "hftrain.launch.launcher --config_file" in r.stdout  # accelerate's launch command, signals told (issue 33)
    info = json.load(open(out / "run_info.json"))
    assert info["world_size"] == 2 and info["wrapper"] == "DistributedDataParallel"
    acc = yaml.safe_load(open(out / "ddp.yaml"))
    assert acc["num_processes"] == 2 and acc["distributed_type"] == "MULTI_GPU"


def _async_io_ok() -> bool:
    from hftrain.launch.machine import async_io_problem

    return async_io_problem() is None


@pytest.mark.launches
@pytest.mark.skipif(not _async_io_ok(), reason="libaio missing (scripts/setup.sh installs libaio-dev)")
def test_zero_infinity_swaps_to_nvme_and_saves_a_loadable_model(tmp_path, deepspeed_ops):
    """A model with matrices of several MiB (DeepSpeed swaps only tensors >= 1 MiB) on 2 ranks."""
    from transformers import AutoModelForCausalLM

    from hftrain.constants import PROBE_IDS
    from hftrain.tiny import build_tiny_model, texts_of_jsonl

    model_dir = build_tiny_model(str(tmp_path / "base"), texts_of_jsonl([DEMO_TRAIN]), vocab_size=300,
                                 config={"hidden_size": 256, "intermediate_size": 3072, "num_hidden_layers": 2,
                                         "num_attention_heads": 4, "num_key_value_heads": 4})
    nvme, od = tmp_path / "nvme", tmp_path / "out"
    nvme.mkdir()

    def launch(strategy, out, *extra):
        return run([*ACCELERATE_LAUNCH, "--config_file", f"accelerate_configs/{strategy}.yaml",
                    "--main_process_port", str(free_port()), "recipes/sft.py",
                    os.path.join(REPO, "recipes/demo/sft.yaml"), f"model.name_or_path={model_dir}",
                    f"data.sources.0.path={DEMO_TRAIN}", "data.eval_sources=[]", "training.eval_strategy=no",
                    "eval.exact_match=0", f"training.output_dir={out}", "training.max_steps=6",
                    "training.per_device_train_batch_size=4", "training.report_to=none", "training.logging_steps=1",
                    "training.train_sampling_strategy=sequential", "training.lr_scheduler_type=constant",
                    "training.warmup_steps=0", *extra], timeout=900)

    r = launch("zero_infinity", od, f"strategy.nvme_path={nvme}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    # The same run with everything in CPU memory instead of on NVMe: the swap must not change the numbers
    # (FEASIBILITY.md once saw optimizer-on-NVMe drift with 2 ranks; the generated config does not).
    r = launch("zero3_offload", tmp_path / "cpu")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]

    def losses(out):
        return [h["loss"] for h in json.load(open(out / "trainer_state.json"))["log_history"] if "loss" in h]

    assert len(losses(od)) == 6
    within("strategies.nvme_vs_cpu_offload.losses", losses(od), losses(tmp_path / "cpu"))
    info = json.load(open(od / "run_info.json"))
    assert info["zero_stage"] == 3 and info["offload_param"] == "nvme" and info["offload_optimizer"] == "nvme"
    swapped = [p for p in nvme.rglob("*.swp")]
    assert any("optimizer" in str(p) for p in swapped), sorted(nvme.rglob("*"))
    assert any("params" in str(p) for p in swapped), sorted(nvme.rglob("*"))
    assert {p.parent.name for p in swapped} >= {"rank0", "rank1"}
    model = AutoModelForCausalLM.from_pretrained(str(od), dtype=torch.float32).eval()
    ids = torch.tensor(PROBE_IDS) % model.config.vocab_size
    with torch.no_grad():
        within("strategies.saved_vs_run.probe_logits", model(input_ids=ids).logits,
               torch.tensor(info["probe_logits"]), label="zero_infinity")


def test_batch_arithmetic_preflight():
    from hftrain.launch.data_checks import batch_problem

    assert batch_problem(2, 4, 2, True, 16) is None
    assert re.search("one optimizer step needs 16 examples .* the data has 15", batch_problem(2, 4, 2, True, 15))
    assert batch_problem(2, 4, 2, False, 3) is None  # a short step still trains


def test_an_epoch_that_leaves_its_last_round_of_micro_batches_short_is_said_to_train_repeats():
    from hftrain.launch.data_checks import repeats_warning

    said = repeats_warning(4, 2, False, 18, "examples")
    assert "18 training examples are not a multiple of 4 processes x per_device_train_batch_size 2 = 8" in said
    assert "completed with 6 repeats" in said and "use a multiple of 8 examples" in said
    assert repeats_warning(4, 2, False, 16, "examples") is None
    assert repeats_warning(1, 2, False, 17, "examples") is None  # one process: a short last step, no repeats
    assert repeats_warning(4, 2, True, 18, "examples") is None  # drop_last: the short round is dropped


def test_launch_runs_the_same_preflight_as_the_run(tmp_path, capsys):
    from hftrain.cli import main

    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump({"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d"}]},
                                   "strategy": {"name": "zero3_offload"}, "training": {"optim": "sgd"}}))
    with pytest.raises(SystemExit) as e:
        main(["launch", str(rec), "--dry-run"])
    assert e.value.code == 2
    assert "training.optim: 'sgd' cannot be used with 'zero3_offload'" in capsys.readouterr().err


def test_launch_on_machine_k_renders_its_own_config_outside_output_dir(tmp_path, capsys):
    """Two machines sharing output_dir: each `hftrain launch` renders a config of its own machine_rank, in a private
    temporary folder; nothing is written into output_dir before the run's own checks."""
    from hftrain.cli import main

    rec = tmp_path / "r.yaml"
    out = tmp_path / "out"
    rec.write_text(yaml.safe_dump({"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d"}]},
                                   "training": {"output_dir": str(out)},
                                   "strategy": {"name": "zero3", "num_machines": 2, "num_processes": 4,
                                                "main_process_ip": "10.0.0.1", "main_process_port": free_port()}}))
    configs = []
    for k in (0, 1):
        assert main(["launch", str(rec), "--dry-run", "--machine-rank", str(k)]) == 0
        printed = capsys.readouterr().out
        cmd, acc = printed.split("\n", 1)
        configs.append(yaml.safe_load(acc))
        assert f"strategy.machine_rank={k}" in cmd  # the workers see the same recipe as the launcher
        assert str(out) not in cmd.split("--config_file ")[1].split()[0]
    assert [c["machine_rank"] for c in configs] == [0, 1]
    assert all(c["num_machines"] == 2 and c["num_processes"] == 4 and c["main_process_ip"] == "10.0.0.1"
               for c in configs)
    assert all(c["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard" for c in configs)
    assert not out.exists()


def test_launch_on_several_machines_needs_the_main_address(tmp_path, capsys):
    from hftrain.cli import main

    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump({"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d"}]},
                                   "strategy": {"name": "ddp", "num_machines": 2, "num_processes": 2}}))
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        main(["launch", str(rec), "--dry-run", f"model.name_or_path={base}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "strategy.main_process_ip is unset" in err, err
    assert main(["launch", str(rec), "--dry-run", f"model.name_or_path={base}", "--machine-rank", "0",
                 "strategy.main_process_ip=10.0.0.1", f"strategy.main_process_port={free_port()}"]) == 0  # control


def _held_port_recipe(tmp_path, strategy: dict) -> tuple[str, str]:
    rec, base = tmp_path / "r.yaml", tmp_path / "base"
    base.mkdir(exist_ok=True)
    (base / "config.json").write_text("{}")
    rec.write_text(yaml.safe_dump({"model": {"name_or_path": str(base)}, "data": {"sources": [{"path": "d"}]},
                                   "strategy": strategy}))
    return str(rec)


@pytest.mark.parametrize("name", ("ddp", "zero3"))
def test_a_port_held_on_machine_0_is_blamed_on_the_port_and_never_checked_elsewhere(tmp_path, capsys, name):
    """The port the test itself holds (a listening socket): machine 0's dry run and `check` name
    strategy.main_process_port, the port and this process as its holder, not strategy.num_machines; machine 1 binds
    nothing (it connects to machine 0) and never looks at a local port."""
    from hftrain.cli import main

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        rec = _held_port_recipe(tmp_path, {"name": name, "num_machines": 2, "num_processes": 2,
                                           "main_process_ip": "10.0.0.1", "main_process_port": port})
        for command in (["launch", rec, "--dry-run", "--machine-rank", "0"], ["check", rec, "--no-data",
                                                                               "strategy.machine_rank=0"]):
            with pytest.raises(SystemExit) as e:
                main(command)
            err = capsys.readouterr().err
            assert e.value.code == 2, err
            assert f"strategy.main_process_port ({port}): the port is in use on this machine" in err, err
            assert f"held by pid {os.getpid()}" in err and "num_machines" not in err, err
        assert main(["launch", rec, "--dry-run", "--machine-rank", "1"]) == 0
        config = yaml.safe_load(capsys.readouterr().out.split("\n", 1)[1])
        assert (config["machine_rank"], config["main_process_port"]) == (1, port)
    # the control: the same dry run on machine 0 once the port is free again
    assert main(["launch", rec, "--dry-run", "--machine-rank", "0"]) == 0


def test_one_machine_judges_a_held_port_only_where_the_recipe_chose_it(tmp_path, capsys):
    """One machine: a port the recipe chose is the launch's and, held, refused naming it; with none chosen accelerate
    moves to a free port itself when its default is taken (its standalone rendezvous), so nothing is judged."""
    from hftrain.cli import main
    from hftrain.launch.machines import held_port_problem

    rec = _held_port_recipe(tmp_path, {"name": "zero2", "num_processes": 2})
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            main(["launch", rec, "--dry-run", f"strategy.main_process_port={port}"])
        assert e.value.code == 2
        assert "remove strategy.main_process_port to let the launch pick one" in capsys.readouterr().err
        assert held_port_problem(port, 1, 0, chosen=False) is None
        assert held_port_problem(port, 1, 0, chosen=True)[0] == "strategy.main_process_port"  # the control
