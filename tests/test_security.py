"""Security: the Hub token never lands in a file a run writes or in its logs; weights load only through
safetensors or torch.load(weights_only=True); remote code runs only when the recipe says so."""

import ast
import os
import pathlib
import shutil

import pytest
import torch
import yaml

from hftrain.modeling import ModelError, load_model
from hftrain.config import ModelSection

from .conftest import DEMO_EVAL, DEMO_TRAIN, PY, REPO, run

TOKEN = "hf_secretTOKEN0123456789abcdefghijklmnopq"
PACKAGE = pathlib.Path(REPO) / "hftrain"


@pytest.mark.launches
def test_token_in_the_environment_is_written_nowhere(tmp_path, tiny_model_dir):
    """A full single-process run (checkpoints, TensorBoard, eval, curves, final save) with HF_TOKEN set: no file
    under output_dir and neither stdout nor stderr holds the token, in text or in bytes."""
    out = tmp_path / "out"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": tiny_model_dir, "dtype": "float32"},
        "data": {"sources": [{"path": DEMO_TRAIN}], "eval_sources": [{"path": DEMO_EVAL}], "max_length": 32},
        "eval": {"exact_match": 2, "max_new_tokens": 4},
        "training": {"output_dir": str(out), "max_steps": 2, "save_steps": 1, "per_device_train_batch_size": 2,
                     "eval_strategy": "steps", "eval_steps": 2, "logging_steps": 1, "report_to": "tensorboard",
                     "disable_tqdm": True},
    }))
    r = run([PY, "recipes/sft.py", str(recipe)], env={"HF_TOKEN": TOKEN, "HUGGING_FACE_HUB_TOKEN": TOKEN})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    kinds = {p.name for p in files}
    # What was searched: weights, optimizer pickles, trainer_state, the recipe, TensorBoard events, run_info.
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "recipe.yaml", "run_info.json",
            "training_args.bin"} <= kinds, kinds
    assert any(n.startswith("events.out.tfevents") for n in kinds)
    for p in files:
        assert TOKEN.encode() not in p.read_bytes(), p
    assert TOKEN not in r.stdout and TOKEN not in r.stderr


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def test_package_loads_no_pickle_and_never_forces_remote_code():
    """Every torch.load in hftrain passes weights_only=True; no pickle/marshal/dill loads; no literal
    trust_remote_code=True; model loading asks for safetensors."""
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")) + [pathlib.Path(REPO) / "recipes" / "sft.py"]:
        tree = ast.parse(path.read_text())
        for node, name in _calls(tree):
            kw = {k.arg: k.value for k in node.keywords}
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            if name.endswith("torch.load"):
                wo = kw.get("weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    offences.append(f"{where}: {ast.unparse(node)}")
            if name in ("pickle.load", "pickle.loads", "marshal.loads", "dill.load", "cloudpickle.load"):
                offences.append(f"{where}: {ast.unparse(node)}")
            trc = kw.get("trust_remote_code")
            if isinstance(trc, ast.Constant) and trc.value is True:
                offences.append(f"{where}: trust_remote_code=True")
    assert not offences, offences
    assert "from torch import load" not in "".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    src = (PACKAGE / "modeling" / "model.py").read_text()
    assert "use_safetensors=True" in src


def test_trust_remote_code_defaults_off_and_follows_the_recipe(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert ModelSection(name_or_path="m").trust_remote_code is False
    seen = []
    real_model, real_tok = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def model_spy(*a, **kw):
        seen.append(("model", kw.get("trust_remote_code"), kw.get("use_safetensors")))
        return real_model(*a, **kw)

    def tok_spy(*a, **kw):
        seen.append(("tokenizer", kw.get("trust_remote_code"), None))
        return real_tok(*a, **kw)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", model_spy)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", tok_spy)
    from hftrain.modeling import load_tokenizer

    load_model(ModelSection(name_or_path=tiny_model_dir))
    load_tokenizer(ModelSection(name_or_path=tiny_model_dir))
    load_model(ModelSection(name_or_path=tiny_model_dir, trust_remote_code=True))
    assert seen == [("model", False, True), ("tokenizer", False, None), ("model", True, True)]


def test_pickle_only_model_is_refused(tmp_path, tiny_model_dir):
    """A folder whose weights are a pickle (pytorch_model.bin) is refused with the reason and the conversion."""
    d = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir, d)
    os.remove(d / "model.safetensors")
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    with pytest.raises(ModelError, match=r"model.name_or_path: .*pickled holds pickle weights only "
                                         r"\(pytorch_model.bin\); hftrain loads safetensors only"):
        load_model(ModelSection(name_or_path=str(d)))


def test_checkpoint_resume_loads_through_safe_paths(tmp_path):
    """What Trainer resume reads from a DDP/single-process checkpoint: model.safetensors, and the optimizer,
    scheduler and RNG through torch.load(weights_only=True) (transformers 5.23's Trainer, checked in its source)."""
    import inspect
    import textwrap

    from transformers import Trainer

    for fn in (Trainer._load_optimizer_and_scheduler, Trainer._load_rng_state, Trainer._load_from_checkpoint):
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        loads = [node for node, name in _calls(tree) if name.endswith("torch.load")]
        for node in loads:
            kw = {k.arg: k.value for k in node.keywords}
            assert isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True, \
                f"{fn.__name__}: {ast.unparse(node)}"


REMOTE_MODELING = '''
from transformers import LlamaConfig, LlamaForCausalLM


class ShoutConfig(LlamaConfig):
    model_type = "shout"


class ShoutForCausalLM(LlamaForCausalLM):
    config_class = ShoutConfig
    RAN = True
'''


def test_trust_remote_code_names_the_code_it_runs(tmp_path, tiny_model_dir, capsys):
    """A checkpoint shipping its own modelling code: the run says which classes and files (with their sha256) it
    is about to execute, and then really loads the shipped class."""
    import json

    from hftrain import modeling

    d = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, d)
    (d / "modeling_shout.py").write_text(REMOTE_MODELING)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="shout", architectures=["ShoutForCausalLM"],
               auto_map={"AutoConfig": "modeling_shout.ShoutConfig",
                         "AutoModelForCausalLM": "modeling_shout.ShoutForCausalLM"})
    (d / "config.json").write_text(json.dumps(cfg))
    model = load_model(ModelSection(name_or_path=str(d), trust_remote_code=True))
    assert type(model).__name__ == "ShoutForCausalLM" and model.RAN
    err = capsys.readouterr().err
    digest = __import__("hashlib").sha256(REMOTE_MODELING.encode()).hexdigest()[:12]
    assert "model.trust_remote_code is true: loading" in err
    assert "config.json auto_map AutoModelForCausalLM -> modeling_shout.ShoutForCausalLM" in err
    assert f"modeling_shout.py (sha256 {digest})" in err
    modeling.warn_remote_code(ModelSection(name_or_path=str(d), trust_remote_code=True), str(d))
    assert capsys.readouterr().err == ""  # said once per folder
    # A folder that ships no code has nothing to name.
    assert modeling.remote_code(str(tiny_model_dir)) == []
