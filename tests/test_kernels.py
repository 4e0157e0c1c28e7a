"""model.kernels: liger (issue 42, point 1): refused with the reason where it cannot run (no liger-kernel, no CUDA
GPU: this machine), by `hftrain check` and by the run alike. Its effect on a GPU: bench/kernels.py."""

import importlib.util

import pytest
import yaml

from hftrain.config import ModelSection, RecipeError
from hftrain.errors import ModelError
from hftrain.launch.preflight import check_recipe
from hftrain.modeling import load_model


def _recipe(tmp_path, model_dir) -> str:
    tree = {"model": {"name_or_path": model_dir, "kernels": "liger"}, "data": {"sources": [{"path": "d.jsonl"}]},
            "training": {"output_dir": str(tmp_path / "o")}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def _pretend(monkeypatch, installed: bool):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        (find_spec("json") if installed else None) if name == "liger_kernel" else find_spec(name, *a)))


@pytest.mark.parametrize("installed", [False, True], ids=["not-installed", "no-cuda"])
def test_liger_is_refused_where_it_cannot_run(tmp_path, tiny_model_dir, monkeypatch, installed):
    _pretend(monkeypatch, installed)
    why = (r"liger needs liger-kernel, which is not installed here: `pip install liger-kernel`" if not installed else
           r"liger's kernels are Triton kernels for CUDA GPUs, and this machine has none; remove model.kernels")
    with pytest.raises(RecipeError, match=r"r.yaml: model.kernels: " + why):
        check_recipe(_recipe(tmp_path, tiny_model_dir))
    with pytest.raises(ModelError, match=r"model.kernels: " + why):
        load_model(ModelSection(name_or_path=tiny_model_dir, kernels="liger"))
