"""training.loss_impl: fused (issue #54, kernels): liger-kernel's fused linear cross-entropy is asked for, never taken
in silence (not by auto, nor chunked, on a CUDA machine with liger-kernel installed); asked for where it cannot run it
is refused by `hftrain check` and the run alike; it projects only the rows with a target, as the chunked loss does,
and gives the chunked loss's sum and gradients. Liger needs a GPU: its module is replaced by a torch stand-in here,
and "a CUDA machine with liger-kernel" is pretended (bench/gpu.py measures the kernel itself on a GPU)."""

import pytest
import torch

from hftrain import losses
from hftrain.constants import IGNORE_INDEX
from hftrain.errors import ModelError
from hftrain.losses import fused_ce
from hftrain.losses.chunked_ce import HeadMath
from tests.exactness import within

from .test_bad_input import W, run_check, run_main, pin_launcher, snapshot
from .test_chunked_loss import grads, loss_and_grads, problem, tiny_lm, trainer_case, trainer_for


class LigerStandIn(torch.nn.Module):
    """liger-kernel's LigerFusedLinearCrossEntropyLoss as hftrain calls it (module(weight, hidden, targets, bias),
    reduction "sum", ignore_index, label smoothing, soft-cap), computed with torch on CPU. It records the rows of each
    call, so a test sees that the fused path ran and what it was given."""

    calls: list = []

    def __init__(self, ignore_index, label_smoothing, reduction, softcap):
        super().__init__()
        assert reduction == "sum"
        self.ignore_index, self.label_smoothing, self.softcap = ignore_index, label_smoothing, softcap

    def forward(self, weight, hidden, targets, bias=None):
        LigerStandIn.calls.append((tuple(hidden.shape), int((targets == self.ignore_index).sum())))
        logits = torch.nn.functional.linear(hidden, weight, bias).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return torch.nn.functional.cross_entropy(logits, targets, ignore_index=self.ignore_index, reduction="sum",
                                                 label_smoothing=self.label_smoothing)


@pytest.fixture
def cuda_with_liger(monkeypatch):
    """This machine as a CUDA one with liger-kernel installed, as far as the loss's dispatch can tell (before #54 its
    gate was fused_ce.usable; now machine_problem), with the stand-in in place of Liger's module."""
    monkeypatch.setattr(fused_ce, "machine_problem", lambda device_type: None, raising=False)
    monkeypatch.setattr(fused_ce, "usable", lambda device, math, mode: (
        mode == "token" and math.scale is None and math.divide is None), raising=False)
    monkeypatch.setattr(fused_ce, "_liger_loss", lambda smoothing, softcap: LigerStandIn(
        IGNORE_INDEX, smoothing, "sum", softcap))
    LigerStandIn.calls = []
    return LigerStandIn.calls


@pytest.mark.parametrize("impl", ["auto", "chunked"])
def test_on_a_cuda_machine_with_liger_the_fused_loss_runs_only_when_asked(impl, cuda_with_liger, tmp_path, capsys):
    _, model, batch, _ = trainer_case("tied")
    _, ref, ref_grads = loss_and_grads(model, "logits", tmp_path, batch)
    _, got, grads_ = loss_and_grads(model, impl, tmp_path, batch)
    assert cuda_with_liger == []  # hftrain's own chunks, not liger's kernel
    out = capsys.readouterr().out
    assert ("hftrain: loss: hftrain's chunked cross-entropy over the target rows, no full logits (training.loss_impl: "
            f"{impl}; liger-kernel's fused loss only with training.loss_impl: fused)") in out
    within("chunked_loss.trainer_step.loss", got, ref, label=impl)
    _, fused, _ = loss_and_grads(model, "fused", tmp_path, batch)
    assert len(cuda_with_liger) == 1
    within("fused_loss.vs_chunked.loss", fused, got)
    assert "hftrain: loss: liger-kernel's fused linear cross-entropy over the target rows (training.loss_impl: " \
        "fused)" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["tied", "untied", "packed", "gemma2_softcap", "label_smoothing"])
def test_the_fused_loss_gets_only_the_target_rows_and_equals_the_chunked_loss(case, cuda_with_liger, tmp_path):
    _, model, batch, kwargs = trainer_case(case)
    _, ref, ref_grads = loss_and_grads(model, "chunked", tmp_path, batch, **kwargs)
    trainer, got, grads_ = loss_and_grads(model, "fused", tmp_path, batch, **kwargs)
    targets = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert targets < batch["labels"][:, 1:].numel()  # the batch has prompt rows: they must not reach the kernel
    assert cuda_with_liger == [((targets, model.config.hidden_size), 0)]
    assert trainer._fused
    within("fused_loss.vs_chunked.loss", got, ref)
    assert ref_grads.keys() == grads_.keys()
    within("fused_loss.vs_chunked.grads", grads_, ref_grads)


@pytest.mark.parametrize("aligned", [False, True], ids=["labels", "sequence-parallel-slice"])
def test_the_fused_sum_over_target_rows_equals_the_chunked_sum(aligned, cuda_with_liger):
    """losses' fused dispatch itself (the SFT loss and a sequence-parallel slice's): the stand-in gets the target rows
    only and the sum and gradients are the chunked path's, a hole inside a row and a bias included."""
    hidden, weight, bias, labels = problem(bias=True)
    targets = labels[:, 1:]
    if aligned:
        weights = (targets != IGNORE_INDEX).reshape(-1).float()
        sums = [losses.aligned_hidden_loss_sum(hidden[:, :-1], weight, bias, targets, weights, chunk_size=4,
                                               fused=fused) for fused in (False, True)]
    else:
        sums = [losses.hidden_loss_sum(hidden, weight, bias, labels, chunk_size=4, fused=fused)
                for fused in (False, True)]
    assert cuda_with_liger == [((int((targets != IGNORE_INDEX).sum()), hidden.shape[-1]), 0)]
    within("fused_loss.sum_vs_chunked.sum", sums[1], sums[0])
    within("fused_loss.sum_vs_chunked.grads", grads(sums[1], hidden, weight, bias),
           grads(sums[0], hidden, weight, bias))


def test_a_micro_batch_without_targets_gives_zero_and_zero_gradients(cuda_with_liger):
    hidden, weight, _, labels = problem()
    labels[:] = IGNORE_INDEX
    got = losses.hidden_loss_sum(hidden, weight, None, labels, fused=True)
    assert float(got.detach()) == 0.0 and cuda_with_liger == []
    assert all(float(g.abs().sum()) == 0.0 for g in grads(got, hidden, weight))


@pytest.mark.parametrize("case, expected", [
    ("sequence", "cannot compute training.loss_averaging: sequence"),
    ("cohere", "the model multiplies its logits by a logit scale (4.0)"),
    ("granite", "the model divides its logits by logits_scaling (0.25)")])
def test_the_trainer_refuses_the_fused_loss_where_it_computes_something_else(case, expected, cuda_with_liger,
                                                                            tmp_path):
    _, model, _, kwargs = trainer_case(case)
    with pytest.raises(ModelError, match=r"training.loss_impl: fused .*" + expected.replace("(", r"\(").replace(
            ")", r"\)") + r".*set training.loss_impl: chunked"):
        trainer_for(model, "fused", tmp_path, **kwargs)


def test_the_machine_and_the_head_it_runs_on(monkeypatch):
    assert fused_ce.head_problem(HeadMath()) is None and fused_ce.head_problem(HeadMath(softcap=30.0)) is None
    assert "logit scale" in fused_ce.head_problem(HeadMath(scale=0.25))
    assert "logits_scaling" in fused_ce.head_problem(HeadMath(divide=4.0))
    monkeypatch.setattr(fused_ce, "installed", lambda: True)
    assert "Triton kernel for CUDA GPUs" in fused_ce.machine_problem("cpu") and fused_ce.machine_problem("cuda") is None
    monkeypatch.setattr(fused_ce, "installed", lambda: False)
    assert "not installed here (`pip install liger-kernel`)" in fused_ce.machine_problem("cuda")


# -- check and the run refuse alike -------------------------------------------------------------------------------

def _pretend(monkeypatch, installed: bool, cuda: bool):
    monkeypatch.setattr(fused_ce, "installed", lambda: installed)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)


def _recipe(w: W, *edits) -> list[str]:
    def edit(tree):
        tree["training"]["loss_impl"] = "fused"
        for path, value in edits:
            section, key = path.split(".")
            tree[section][key] = value
    return [w.recipe(edit)]


@pytest.mark.parametrize("installed, cuda, edits, expected", [
    (False, False, (), "training.loss_impl: fused cannot run here: it needs liger-kernel, which is not installed here "
     "(`pip install liger-kernel`); set training.loss_impl: chunked"),
    (True, False, (), "training.loss_impl: fused cannot run here: liger's fused kernel is a Triton kernel for CUDA "
     "GPUs, and this run has none; set training.loss_impl: chunked"),
    (True, False, [("training.loss_averaging", "sequence")], "training.loss_impl: fused (liger-kernel's fused linear "
     "cross-entropy) sums the token CE, every target weighing 1, and cannot compute training.loss_averaging: "
     "sequence"),
    (True, False, [("model.kernels", "none")], "training.loss_impl: fused is liger-kernel's fused linear "
     "cross-entropy, and model.kernels: none turns liger's kernels off; set training.loss_impl: chunked"),
], ids=["not-installed", "no-cuda", "sequence-average", "kernels-none"])
def test_check_and_the_run_refuse_the_fused_loss_where_it_cannot_run(installed, cuda, edits, expected, tmp_path,
                                                                    tiny_model_dir, monkeypatch, capsys):
    _pretend(monkeypatch, installed, cuda)
    w = W(str(tmp_path), tiny_model_dir)
    argv = _recipe(w, *edits)
    pin_launcher(argv, w.env)
    code, err = run_check(argv, capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    checked = err[err.index("hftrain: error:"):]
    assert expected in checked, checked
    code = run_main(argv, w.env, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err[err.index("hftrain: error:"):] == checked
    assert snapshot(w.out) == {}


def test_check_refuses_a_head_liger_cannot_compute(tmp_path, monkeypatch):
    """Cohere's logit scale, read from the model built from its config on the meta device, before anything loads."""
    from hftrain.config import Recipe
    from hftrain.config.sections import ModelSection
    from hftrain.launch.model_libraries import fused_loss_problems

    _pretend(monkeypatch, True, True)
    tiny_lm(kind="cohere").config.save_pretrained(tmp_path / "cohere")
    tiny_lm().config.save_pretrained(tmp_path / "llama")
    recipe = Recipe(model=ModelSection(name_or_path=str(tmp_path / "cohere")), data=None,
                    training={"loss_impl": "fused"})
    assert fused_loss_problems(recipe) == [("training.loss_impl", "training.loss_impl: fused cannot run here: the "
                                            "model multiplies its logits by a logit scale (4.0), which liger's "
                                            f"kernel has not; {fused_ce.FIX}")]
    recipe = Recipe(model=ModelSection(name_or_path=str(tmp_path / "llama")), data=None,
                    training={"loss_impl": "fused"})
    assert fused_loss_problems(recipe) == []


def test_the_keys_say_what_each_controls():
    import dataclasses

    from hftrain.config.sections import ModelSection
    from hftrain.config.training import HFTrainOptions

    kernels = {f.name: f for f in dataclasses.fields(ModelSection)}["kernels"].metadata["help"]
    loss = {f.name: f for f in dataclasses.fields(HFTrainOptions)}["loss_impl"].metadata["help"]
    assert kernels.startswith("The model's layers only (the loss is training.loss_impl's)")
    assert "model.kernels does not choose it" in loss and "fused: liger-kernel's fused linear cross-entropy" in loss
    assert "never by auto" in loss


@pytest.mark.parametrize("impl", ["chunked", "fused"])
def test_lora_on_lm_head_is_refused_with_either_head_loss(impl):
    from hftrain.config import RecipeError
    from hftrain.methods import load_recipe

    raw = {"model": {"name_or_path": "m", "lora": {"r": 4, "target_modules": ["lm_head"]}},
           "data": {"sources": [{"path": "d.jsonl"}]}, "training": {"loss_impl": impl}}
    with pytest.raises(RecipeError, match=f"model.lora.target_modules: reaches lm_head, which training.loss_impl: "
                       f"{impl} cannot compute through"):
        load_recipe(None, [], raw=raw)
