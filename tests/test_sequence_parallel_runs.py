"""strategy.sequence_parallel: 2 on 2 CPU ranks (gloo) equals one process without it on the same batches: losses,
weights after the first step and at the end (fp32, within named bounds: tests/exactness.py), eval loss and exact
match; under ZeRO-3 (padded rows, token averaging, the chunked loss of an untied head) and ZeRO-2 (packed rows,
sequence averaging, the chunked loss, LoRA, activation checkpointing); a resume mid-epoch; and, without hftrain's
patch, ZeRO-2's gradients (the loss from logits) exactly twice the reference. The references are one process with
the loss from logits.

Each step takes 2 x 3 examples (per_device_train_batch_size 2, gradient_accumulation_steps 3, one group of 2 ranks:
data-parallel size 1), in order (sequential sampling), with plain SGD and no clipping, so that the weights after a
step are w - lr * gradient and any scaling of the gradient shows."""

import json

import pytest
import yaml
from safetensors.torch import load_file

from .exactness import beyond, within
from .support import free_port

from .conftest import ACCELERATE_LAUNCH, DEMO_TRAIN, PY, SMALL, run, run_matrix, uneven_data

LR = 0.5
STEPS = 3
# name: (model, strategy, sequence_parallel, script, training overrides, data overrides, model overrides)
PACKED_LORA = ({"loss_averaging": "sequence"}, {"packing": True},
               {"lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "gradient_checkpointing": True})
RUNS = {
    "ref": ("untied", None, 1, "recipes/sft.py", {"loss_impl": "logits"}, {}, {}),
    "z3": ("untied", "zero3", 2, "recipes/sft.py", {"loss_impl": "chunked"}, {}, {}),
    "ref_lora": ("tied", None, 1, "recipes/sft.py", {**PACKED_LORA[0], "loss_impl": "logits"}, *PACKED_LORA[1:]),
    "z2_lora": ("tied", "zero2", 2, "recipes/sft.py", {**PACKED_LORA[0], "loss_impl": "chunked"}, *PACKED_LORA[1:]),
    "z2_unpatched": ("untied", "zero2", 2, "tests/sp_unpatched.py",
                     {"loss_impl": "logits", "max_steps": 1, "eval_strategy": "no"}, {}, {}),
}


def recipe(tmp, name, model_dir, data, held_out, strategy, n, training, data_over, model_over, **extra):
    tree = {
        "model": {"name_or_path": model_dir, "dtype": "float32", **model_over},
        "data": {"sources": [{"path": data}], "eval_sources": [{"path": held_out}], "max_length": 64, **data_over},
        "training": {"output_dir": str(tmp / name), "max_steps": STEPS, "per_device_train_batch_size": 2,
                     "per_device_eval_batch_size": 2, "gradient_accumulation_steps": 3, "optim": "sgd",
                     "learning_rate": LR, "lr_scheduler_type": "constant", "max_grad_norm": 0.0, "weight_decay": 0.0,
                     "logging_steps": 1, "save_steps": 1, "save_total_limit": None, "eval_strategy": "steps",
                     "eval_steps": STEPS, "train_sampling_strategy": "sequential", "seed": 0, "report_to": "none",
                     "disable_tqdm": True, **training, **extra},
        "eval": {"exact_match": 2, "max_new_tokens": 4},
    }
    if strategy:
        tree["strategy"] = {"name": strategy, "sequence_parallel": n}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def launch(path, strategy, script):
    cmd = [*ACCELERATE_LAUNCH, "--config_file", f"accelerate_configs/{strategy}.yaml", "--main_process_port",
           str(free_port()), script, str(path)]
    r = run(cmd, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def common(a: dict, b: dict) -> tuple[dict, dict]:
    """a and b on their common keys: savers differ only in whether they also write the tied lm_head.weight."""
    assert {k for k in a if k != "lm_head.weight"} == {k for k in b if k != "lm_head.weight"}
    keys = a.keys() & b.keys()
    return {k: a[k] for k in keys}, {k: b[k] for k in keys}


def result(out):
    state = json.load(open(out / "trainer_state.json"))
    weights = "adapter_model.safetensors" if (out / "adapter_model.safetensors").exists() else "model.safetensors"
    return {"losses": [h["loss"] for h in state["log_history"] if "loss" in h],
            "tokens": [h["target_tokens_per_step"] for h in state["log_history"] if "loss" in h],
            "eval": [h["eval_loss"] for h in state["log_history"] if "eval_loss" in h],
            "step1": load_file(str(out / "checkpoint-1" / weights)) if (out / "checkpoint-1").exists() else None,
            "final": load_file(str(out / weights)) if (out / weights).exists() else None,
            "info": json.load(open(out / "run_info.json")) if (out / "run_info.json").exists() else None}


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory):
    """spiky_model_dir's model with its own output head (ZeRO-3 partitions it apart from the embedding)."""
    from hftrain.tiny import build_tiny_model, texts_of_jsonl

    out = str(tmp_path_factory.mktemp("untied") / "base")
    return build_tiny_model(out, texts_of_jsonl([DEMO_TRAIN]), config={**SMALL, "initializer_range": 0.3,
                                                                      "tie_word_embeddings": False},
                            vocab_size=300, seed=0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, spiky_model_dir, untied_model_dir, deepspeed_ops):
    tmp = tmp_path_factory.mktemp("sp")
    data, held_out = uneven_data(tmp / "train.jsonl"), uneven_data(tmp / "eval.jsonl", n=6, seed=1)
    models = {"tied": spiky_model_dir, "untied": untied_model_dir}
    out, one_process = {}, {}
    for name, (model, strategy, n, script, training, data_over, model_over) in RUNS.items():
        path = recipe(tmp, name, models[model], data, held_out, strategy, n, training, data_over, model_over)
        if strategy is None:  # the one-process references: one launch (tests/matrix_worker.py)
            one_process[name] = ("hftrain.recipes.sft", [path])
            continue
        launch(path, strategy, script)
        out[name] = result(tmp / name)
    for name, variant in run_matrix([PY], one_process, tmp / "matrix").items():
        variant.check()
        out[name] = result(tmp / name)
    # Resume the ZeRO-3 run after its first step: 3 micro-batches trained, 1 loader batch (2 slices) and 1 slice of
    # the next skipped. The same batches follow, so the end is the uninterrupted run's.
    path = recipe(tmp, "z3_resumed", untied_model_dir, data, held_out, "zero3", 2, RUNS["z3"][4], {}, {},
                  resume_from_checkpoint=str(tmp / "z3" / "checkpoint-1"))
    launch(path, "zero3", "recipes/sft.py")
    out["z3_resumed"] = result(tmp / "z3_resumed")
    return out


@pytest.mark.launches
@pytest.mark.parametrize("ref,other", [("ref", "z3"), ("ref_lora", "z2_lora")])
def test_two_ranks_per_sequence_equal_one_process(runs, ref, other):
    a, b = runs[ref], runs[other]
    assert len(a["losses"]) == STEPS
    within("sequence_parallel.vs_one_process.losses", b["losses"], a["losses"], label=other)
    assert b["tokens"] == a["tokens"]  # each target counted once over the two slices
    within("sequence_parallel.vs_one_process.weights", *common(b["step1"], a["step1"]), label=f"{other} step 1")
    within("sequence_parallel.vs_one_process.weights", *common(b["final"], a["final"]), label=f"{other} final")
    # eval_loss before training, at the last step and from the final evaluate(): each rank its examples, not split
    assert len(a["eval"]) == 3
    within("sequence_parallel.vs_one_process.eval_losses", b["eval"], a["eval"], label=other)
    assert b["info"]["world_size"] == 2
    within("sequence_parallel.vs_one_process.eval_losses", b["info"]["metrics"]["final_eval_loss"],
           a["info"]["metrics"]["final_eval_loss"], label=f"{other} final_eval_loss")
    assert b["info"]["metrics"]["final_exact_match"] == pytest.approx(a["info"]["metrics"]["final_exact_match"],
                                                                      rel=1e-5)


@pytest.mark.launches
def test_resume_mid_epoch_continues_the_same_run(runs):
    a, b = runs["z3"], runs["z3_resumed"]
    assert b["step1"] is None  # it started from the first run's checkpoint-1 (whose log its history keeps)
    within("sequence_parallel.resume_vs_uninterrupted.losses", b["losses"], a["losses"])
    within("sequence_parallel.resume_vs_uninterrupted.weights", *common(b["final"], a["final"]))


@pytest.mark.launches
def test_without_the_patch_zero2_doubles_the_gradient(runs, untied_model_dir):
    """Negative control: DeepSpeed's ZeRO-2 divides the gradient by the data-parallel size (1), not the world (2)."""
    base = load_file(f"{untied_model_dir}/model.safetensors")
    good, bad = runs["ref"]["step1"], runs["z2_unpatched"]["step1"]
    assert bad
    # the loss is right (only its gradient is not)
    within("sequence_parallel.vs_one_process.losses", runs["z2_unpatched"]["losses"][0], runs["ref"]["losses"][0],
           label="z2_unpatched, step 1")
    doubled = {k: base[k] + 2 * (good[k] - base[k]) for k in good if k in base}
    within("sequence_parallel.unpatched_vs_doubled_step.weights", {k: bad[k] for k in doubled}, doubled)
    # and the bound on the weights after a step sees a gradient twice too large
    beyond("sequence_parallel.vs_one_process.weights", *common(bad, good), label="z2_unpatched step 1")
