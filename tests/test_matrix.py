"""Several runs in one launch (tests/matrix_worker.py, conftest.run_matrix): the negative control every merged matrix
relies on. A broken variant is reported under its own name, the variants after it as not run, and the ones before it
keep their outputs; a run after another in the same processes trains as a launch of its own would."""

import json
import os
import subprocess

import pytest
import yaml

from tests.support import free_port

from .conftest import ACCELERATE_LAUNCH, DEMO_TRAIN, REPO, VariantResult, _section, run_matrix

SFT = "hftrain.recipes.sft"


def test_sections_and_check_name_the_variant():
    out = "noise\nhftrain-matrix: variant a\nline a\nhftrain-matrix: variant b\nline b\n"
    assert _section(out, "a") == "line a\n" and _section(out, "b") == "line b\n" and _section(out, "c") == ""
    launch = subprocess.CompletedProcess([], 1, out, "")
    assert VariantResult("a", [{"ok": True}, {"ok": True}], launch).ok
    broken = VariantResult("b", [{"ok": True}, {"ok": False, "error": "boom"}], launch)
    with pytest.raises(AssertionError, match="variant b of the matrix launch failed.*\nrank 1: boom"):
        broken.check()
    with pytest.raises(AssertionError, match="rank 0: not run"):
        VariantResult("c", [None, None], launch).check()


def recipe(tmp_path, name, model, **training) -> str:
    tree = {"model": {"name_or_path": model, "dtype": "float32"},
            "data": {"sources": [{"path": DEMO_TRAIN}], "max_length": 64},
            "eval": {"exact_match": 0},
            "training": {"output_dir": str(tmp_path / name), "max_steps": 2, "per_device_train_batch_size": 2,
                         "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
                         "train_sampling_strategy": "sequential", "disable_tqdm": True, "seed": 0, **training}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


@pytest.mark.launches
def test_a_broken_variant_fails_by_name_and_the_others_are_kept_or_not_run(tmp_path, tiny_model_dir):
    """2 ranks under DDP: the same run twice (the second after the first in the same processes: equal losses), then
    a broken variant (a recipe error: exit 2 on each rank), then one that must not run."""
    variants = {"first": (SFT, [recipe(tmp_path, "first", tiny_model_dir)]),
                "again": (SFT, [recipe(tmp_path, "again", tiny_model_dir)]),
                "broken": (SFT, [recipe(tmp_path, "broken", tiny_model_dir, loss_averaging="bogus")]),
                "after": (SFT, [recipe(tmp_path, "after", tiny_model_dir)])}
    launch = [*ACCELERATE_LAUNCH, "--config_file", os.path.join(REPO, "accelerate_configs/ddp.yaml"),
              "--main_process_port", str(free_port())]
    got = run_matrix(launch, variants, tmp_path / "matrix", ranks=2)
    assert got["first"].ok and got["again"].ok, got["first"].launch.stderr[-3000:]
    assert got["broken"].launch.returncode == 1
    assert not got["broken"].ok and all("exit status 2" in s["error"] for s in got["broken"].statuses)
    assert "training.loss_averaging" in got["broken"].stderr, got["broken"].launch.stderr[-3000:]
    assert got["after"].statuses == [None, None] and not (tmp_path / "after").exists()

    def losses(name):
        history = json.load(open(tmp_path / name / "trainer_state.json"))["log_history"]
        return [h["loss"] for h in history if "loss" in h]

    assert len(losses("first")) == 2 and losses("again") == losses("first")
    assert json.load(open(tmp_path / "again" / "run_info.json"))["world_size"] == 2
