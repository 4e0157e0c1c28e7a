"""Per-part learning rates and training the projector alone (issue 66, item 4): after one SGD step each weight of a
tiny Qwen2.5-VL is where the plain run's move, scaled by its part's rate, puts it; the projector alone trained with
the rest frozen; what trains at what rate printed; the keys refused by name where they cannot be honoured."""

from __future__ import annotations

import pytest
import yaml

from hftrain.vision.freezing import part_of_parameters
from tests.exactness import beyond, within

from .conftest import launch_prefix, run_matrix
from .test_vision import _square_rows, refusals_of_check_and_run, vlm_dirs  # noqa: F401

RATE = 0.1
RATES = {"projector": 1.0, "vision_tower": 0.5}  # 10 x and 5 x the language model's: moves far above rounding
SGD = dict(optim="sgd", learning_rate=RATE, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
           max_steps=1, per_device_train_batch_size=4, seed=0, save_strategy="no", report_to="none",
           logging_steps=1, disable_tqdm=True)


def _variant(folder, name, model, data, **model_keys):
    tree = {"model": {"name_or_path": model, "dtype": "float32", "attn_implementation": "sdpa", **model_keys},
            "data": {"sources": [{"path": data}], "max_length": 256},
            "training": {"output_dir": str(folder / name), **SGD}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return "hftrain.recipes.sft", [str(path)]


@pytest.fixture(scope="module")
def runs(vlm_dirs, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("part_rates")
    model, data = vlm_dirs["qwen2_5_vl"], _square_rows(folder, 4)
    variants = {"plain": _variant(folder, "plain", model, data),
                "rates": _variant(folder, "rates", model, data, part_learning_rates=RATES),
                "projector_alone": _variant(folder, "projector_alone", model, data,
                                            freeze=["vision_tower", "language_model"])}
    return folder, model, run_matrix(launch_prefix(1), variants, folder / "matrix", timeout=600)


def _params(folder) -> dict:
    from transformers import AutoModelForImageTextToText

    return dict(AutoModelForImageTextToText.from_pretrained(str(folder)).named_parameters())


def _moved(model, folder, name):
    """(the base model's parameters, the run's), by their names in the loaded model (the names part_of_parameters
    reads; the saved file's keys are the checkpoint's)."""
    return _params(model), _params(folder / name)


def _parts(model) -> dict[str, str]:
    from transformers import AutoModelForImageTextToText

    loaded = AutoModelForImageTextToText.from_pretrained(model)
    return part_of_parameters(loaded, "qwen2_5_vl")


@pytest.mark.launches
def test_each_part_moves_at_its_own_rate(runs):
    folder, model, variants = runs
    for name in ("plain", "rates"):
        variants[name].check()
    (base, plain), (_, rated) = _moved(model, folder, "plain"), _moved(model, folder, "rates")
    parts = _parts(model)
    factor = {part: RATES.get(part, RATE) / RATE for part in ("vision_tower", "projector", "language_model")}
    reached = {k for k in base if (plain[k] - base[k]).abs().max() > 0}  # a gradient reached it
    assert {parts[k] for k in reached} == {"vision_tower", "projector", "language_model"}
    # each weight where the plain run's move, scaled by its part's rate, puts it (in float64)
    want = {k: base[k].detach().double() + factor[parts[k]] * (plain[k] - base[k]).detach().double() for k in base}
    within("vision.part_rates.weights", {k: v.detach() for k, v in rated.items()}, want)
    beyond("vision.part_rates.weights", {k: v.detach() for k, v in plain.items()}, want)  # one rate for all
    said = variants["rates"].stderr
    assert "hftrain: trains: language_model " in said and " weights at 0.1, projector " in said
    assert " weights at 1, vision_tower " in said and " weights at 0.5" in said


@pytest.mark.launches
def test_the_projector_alone_trains(runs):
    folder, model, variants = runs
    variants["projector_alone"].check()
    (base, alone), parts = _moved(model, folder, "projector_alone"), _parts(model)
    moved = {k: bool((alone[k] - base[k]).abs().max() > 0) for k in base}
    assert all(moved[k] == (parts[k] == "projector") for k in base), [
        k for k in base if moved[k] != (parts[k] == "projector")]
    assert "language_model frozen, projector " in variants["projector_alone"].stderr
    assert "vision_tower frozen" in variants["projector_alone"].stderr


@pytest.mark.parametrize("keys, said", [
    ({"part_learning_rates": {"aligner": 1e-4}}, "model.part_learning_rates.aligner: 'aligner' is not a part of a "
     "qwen2_5_vl model; its parts: language_model, projector, vision_tower"),
    ({"part_learning_rates": {"projector": -1}}, "model.part_learning_rates.projector: must be a positive learning "
     "rate, not -1"),
    ({"part_learning_rates": {"projector": 1e-4}, "freeze": ["projector"]}, "model.part_learning_rates.projector: "
     "projector is in model.freeze: a frozen part has no learning rate"),
    ({"freeze": ["vision_tower", "projector", "language_model"]}, "model.freeze: freezes every part (language_model, "
     "projector, vision_tower): nothing would train")])
def test_what_cannot_be_honoured_is_refused_by_check_and_the_run(vlm_dirs, tmp_path, capsys, monkeypatch,  # noqa: F811
                                                                 keys, said):
    checked, ran = refusals_of_check_and_run(tmp_path, vlm_dirs["qwen2_5_vl"],
                                             lambda tree: tree["model"].update(keys), capsys, monkeypatch)
    assert said in checked and said in ran


def test_part_rates_on_a_text_model_are_refused(tiny_model_dir, tmp_path, capsys, monkeypatch):
    checked, ran = refusals_of_check_and_run(tmp_path, tiny_model_dir, lambda tree: tree["model"].update(
        part_learning_rates={"projector": 1e-4}), capsys, monkeypatch)
    for err in (checked, ran):
        assert "model.part_learning_rates: sets the learning rates of an image-text-to-text model's parts" in err
