"""model.kernels (issue 42, points 1 and 3): `liger` refused with the reason where it cannot run (no liger-kernel, no
CUDA GPU: this machine), by `hftrain check` and by the run alike; unset, liger's kernels where they can run and the
model's own layers elsewhere, the choice said in one line; `none` never. Its effect on a GPU: bench/liger_kernels.py."""

import importlib.util

import pytest
import torch
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
    """This host without a CUDA GPU (whatever it has: these are the CPU paths), liger-kernel installed or not."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        (find_spec("json") if installed else None) if name == "liger_kernel" else find_spec(name, *a)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("installed", [False, True], ids=["not-installed", "no-cuda"])
def test_liger_is_refused_where_it_cannot_run(tmp_path, tiny_model_dir, monkeypatch, installed):
    _pretend(monkeypatch, installed)
    why = (r"liger needs liger-kernel, which is not installed here: `pip install liger-kernel`" if not installed else
           r"liger's kernels are Triton kernels for CUDA GPUs, and this machine has none; remove model.kernels")
    with pytest.raises(RecipeError, match=r"r.yaml: model.kernels: " + why):
        check_recipe(_recipe(tmp_path, tiny_model_dir))
    with pytest.raises(ModelError, match=r"model.kernels: " + why):
        load_model(ModelSection(name_or_path=tiny_model_dir, kernels="liger"))


def _applied(monkeypatch, runnable: bool) -> list:
    """Pretend liger can (or cannot) run here; the models liger's kernels were put into."""
    import hftrain.kernels
    import hftrain.modeling.model

    applied = []
    monkeypatch.setattr(hftrain.kernels, "liger_unavailable",
                        lambda model_type: None if runnable else ("no CUDA GPU", "remove model.kernels"))
    monkeypatch.setattr(hftrain.modeling.model, "apply_liger", applied.append)
    return applied


@pytest.mark.parametrize("runnable", [True, False], ids=["cuda-liger", "elsewhere"])
def test_unset_kernels_take_liger_where_it_runs_and_none_never(tiny_model_dir, monkeypatch, runnable):
    from hftrain.kernels import kernels_line

    applied = _applied(monkeypatch, runnable)
    model = load_model(ModelSection(name_or_path=tiny_model_dir))
    assert applied == ([model] if runnable else [])
    assert kernels_line(None, "llama") == (
        "kernels: liger's RMSNorm, RoPE and SwiGLU (model.kernels unset: the fastest exact path here; `none` turns "
        "them off)" if runnable else "kernels: the model's own layers (model.kernels unset; liger: no CUDA GPU)")
    load_model(ModelSection(name_or_path=tiny_model_dir, kernels="none"))
    assert len(applied) == (1 if runnable else 0)  # `none`: never
    assert kernels_line("none", "llama") == "kernels: the model's own layers (model.kernels: none)"
    assert kernels_line(None, "llama", quantized=True) == (  # liger over bitsandbytes' layers: only when asked
        "kernels: the model's own layers (model.kernels unset; liger: not by default over a quantised base "
        "(model.kernels: liger asks for it))")


@pytest.mark.parametrize("installed", [False, True], ids=["not-installed", "no-cuda"])
def test_unset_kernels_without_a_gpu_say_why_not(monkeypatch, installed):
    """The CPU path on any host (a GPU host included: CUDA is pretended away)."""
    from hftrain.kernels import kernels_line

    _pretend(monkeypatch, installed)
    assert kernels_line(None, "llama") == (
        "kernels: the model's own layers (model.kernels unset; liger: liger's kernels are Triton kernels for CUDA "
        "GPUs, and this machine has none)" if installed else
        "kernels: the model's own layers (model.kernels unset; liger: liger-kernel is not installed here)")
    # asked for where it cannot run: `hftrain plan` said liger's layers would be used, check refused them
    assert kernels_line("liger", "llama") == (
        "kernels: none can run as asked: model.kernels: liger's kernels are Triton kernels for CUDA GPUs, and this "
        "machine has none; remove model.kernels here (the model's own layers run instead) (hftrain check refuses it)"
        if installed else "kernels: none can run as asked: model.kernels: liger needs liger-kernel, which is not "
        "installed here: `pip install liger-kernel` (hftrain check refuses it)")
