"""check == run, as a property (issue 33, point 3): hypothesis draws recipe values (training, data, eval, LoRA,
source weights) and data rows; for each draw `hftrain check` and the run (hftrain.recipes.sft's main() in this
process, the code path `hftrain sft` runs) must agree: both refuse with exit 2 and the same one message, or check
passes and the run reaches its first optimizer step (every library has validated its values by then: TrainingArguments,
the Trainer's dataloaders, optimizer and scheduler, the model, LoRA, the data phase, generation before training).
Neither may ever end in a traceback (any exception other than hftrain's user errors fails the test).

The run stops at its first training step (SFTTrainer.training_step raises): fast, one process, no process group. The
draws are derandomized (the same in every CI run) and the number of examples bounded so that the test stays well
under 3 minutes on a loaded 2-core machine; run it with HFTRAIN_PROPERTY_EXAMPLES=200 to search wider."""

import itertools
import json
import os

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hftrain import outdir  # noqa: E402
from hftrain.methods.sft import SFTTrainer  # noqa: E402

from .test_bad_input import run_check, run_main  # noqa: E402

EXAMPLES = int(os.environ.get("HFTRAIN_PROPERTY_EXAMPLES", "60"))
# A failing draw is printed as drawn; shrinking it can take minutes (HFTRAIN_PROPERTY_SHRINK=1 turns it on).
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if os.environ.get("HFTRAIN_PROPERTY_SHRINK")
                                                          else [])
_COUNTER = itertools.count()


class ReachedTraining(Exception):
    """The run got to its first optimizer step: every check and every library's validation lay behind it."""


def _maybe(strategy):
    return st.one_of(st.none(), strategy)


def _int(*specials, low=-2, high=4):
    """Mostly in [low, high], with the values a library is likely to treat specially."""
    return st.one_of(st.integers(low, high), st.sampled_from(specials)) if specials else st.integers(low, high)


FLOATS = st.sampled_from([1e-3, 0.5, 2.0, 0.0, -1.0, float("nan"), float("inf"), 1e308])
# Each draw sets a few of these keys (most values valid, some not), over a recipe that runs as it is.
VALUES = {
    "training.seed": _int(-1, 2**32 - 1, 2**32, low=0, high=3),
    "training.data_seed": _int(-1, 2**32, low=0, high=3),
    "training.per_device_train_batch_size": _int(0, -1, low=1, high=3),
    "training.per_device_eval_batch_size": _int(0, low=1, high=3),
    "training.gradient_accumulation_steps": _int(0, low=1, high=3),
    "training.learning_rate": FLOATS,
    "training.weight_decay": FLOATS,
    "training.max_grad_norm": FLOATS,
    "training.warmup_steps": _int(-1, low=0, high=3),
    "training.logging_steps": _int(0, -1, low=1, high=3),
    "training.max_steps": _int(0, -1, -2, low=1, high=2),
    "training.lr_scheduler_type": st.sampled_from(["linear", "cosine", "constant", "cosine_with_restarts",
                                                   "polynomial", "inverse_sqrt", "warmup_stable_decay",
                                                   "cosine_warmup_with_min_lr", "reduce_lr_on_plateau"]),
    "training.optim": st.sampled_from(["adamw_torch", "sgd", "adafactor", "adagrad", "rmsprop", "adamw_bnb_8bit",
                                       "lion_32bit"]),
    "training.dataloader_num_workers": _int(-1, low=0, high=0),
    "training.dataloader_persistent_workers": st.booleans(),
    "training.dataloader_prefetch_factor": _maybe(st.integers(-1, 2)),
    "training.dataloader_drop_last": st.booleans(),
    "training.eval_strategy": st.sampled_from(["no", "steps"]),
    "training.eval_steps": _int(0, low=1, high=2),
    "data.max_length": _int(1, 0, low=2, high=48),
    "data.truncation": st.sampled_from(["right", "drop"]),
    "data.packing": st.booleans(),
    "data.num_proc": _maybe(st.integers(-1, 1)),
    "data.eval_fraction": st.sampled_from([0.25, 0.5, 0.9, 0.99, -0.5]),
    "data.skip_untrainable": st.booleans(),
    "data.completion_only_loss": st.booleans(),
    "eval.exact_match": _int(-1, low=0, high=2),
    "eval.max_new_tokens": _int(0, -1, low=1, high=4),
    "model.lora": st.fixed_dictionaries({"r": _int(0, -1, low=1, high=4)}, optional={
        "alpha": _int(0, -4, low=1, high=16),
        "dropout": st.sampled_from([0.0, 0.1, 1.5, -0.5, float("nan")]),
        "target_modules": st.sampled_from(["all-linear", ["q_proj"], ["q_proj", "nope"], []]),
    }),
    "weights": st.tuples(FLOATS, FLOATS),  # a second source, and both sources' weights
}
overrides = st.lists(st.sampled_from(sorted(VALUES)), max_size=3, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({k: VALUES[k] for k in keys}))
rows = st.lists(st.tuples(st.text(alphabet="abc xyz", max_size=30),
                          st.text(alphabet="abc xyz", min_size=1, max_size=30)),
                min_size=1, max_size=10)  # (prompt, completion) rows of the data file


def write_case(tmp: str, model: str, values: dict, pairs) -> str:
    path = os.path.join(tmp, "rows.jsonl")
    with open(path, "w", encoding="utf-8") as fh:
        for prompt, completion in pairs:
            fh.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    tree = {"model": {"name_or_path": model, "dtype": "float32"},
            "data": {"sources": [{"path": path}], "max_length": 32},
            "training": {"output_dir": os.path.join(tmp, "out"), "max_steps": 1, "per_device_train_batch_size": 2,
                         "report_to": "none", "disable_tqdm": True, "save_strategy": "no"},
            "strategy": {"num_processes": 1},  # the world the in-process run sees
            "eval": {}}
    for key, value in values.items():
        if key == "weights":
            tree["data"]["sources"] = [{"path": path, "weight": value[0]}, {"path": path, "weight": value[1]}]
        else:
            section, name = key.split(".")
            tree[section][name] = value
    recipe = os.path.join(tmp, "recipe.yaml")
    with open(recipe, "w", encoding="utf-8") as fh:
        yaml.safe_dump(tree, fh, sort_keys=False)
    return recipe


def _message(err: str) -> str:
    assert "Traceback" not in err, err[-4000:]
    return err[err.index("hftrain: error:"):] if "hftrain: error:" in err else ""


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True, phases=PHASES,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(values=overrides, pairs=rows)
def test_check_and_the_run_agree_and_never_show_a_traceback(values, pairs, tiny_model_dir, tmp_path_factory,
                                                             monkeypatch, capsys):
    import datasets

    tmp = str(tmp_path_factory.mktemp(f"draw{next(_COUNTER)}"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", os.path.join(tmp, "cache"))
    recipe = write_case(tmp, tiny_model_dir, values, pairs)
    capsys.readouterr()

    code, err = run_check([recipe], capsys)  # any exception but hftrain's user errors propagates: a failure
    assert code in (0, 2), f"check ended with {code}:\n{err[-3000:]}"
    checked = _message(err)

    def reached(self, *args, **kwargs):
        raise ReachedTraining

    monkeypatch.setattr(SFTTrainer, "training_step", reached)
    out = os.path.join(tmp, "out")
    try:
        run_code = run_main([recipe], {}, monkeypatch)
        outcome = "finished"  # max_steps may leave no step at all; equally a success
    except ReachedTraining:
        outcome, run_code = "reached training", 0
    finally:
        outdir.release(out)
        monkeypatch.undo()
    ran = _message(capsys.readouterr().err)
    if os.environ.get("HFTRAIN_PROPERTY_LOG"):  # what each draw came to, for tuning the strategies
        with open(os.environ["HFTRAIN_PROPERTY_LOG"], "a") as fh:
            fh.write(json.dumps({"check": code, "run": outcome if code == 0 else run_code, "values": values,
                                 "why": " ".join(checked.split())[:300]}, default=str) + "\n")
    if code == 0:
        assert run_code in (0, None), f"check passed, the run refused ({outcome}):\n{ran}"
    else:
        assert run_code == 2, f"check refused, the run got to {outcome}:\n{checked}"
        assert ran == checked, f"check and run refuse differently:\ncheck: {checked}\nrun:   {ran}"
