"""The house, proven by a method it has never seen: tests/plugin/label_text (text classification on a
sequence-classification head) registers itself through the `hftrain.methods` entry-point group with no edit of
hftrain, and runs through `hftrain --help`, `hftrain check` (its section's schema and rule included) and a 1-step
run whose saved model loads with the Auto class its card names."""

import json
import os

import pytest
import torch
import yaml

from .conftest import PY, REPO, run

pytestmark = pytest.mark.launches

PLUGIN_DIR = os.path.join(REPO, "tests", "plugin")


def installed_plugin(site) -> dict:
    """The environment of a process that sees the stand-in as installed: its package on the path and a dist-info
    declaring its entry point, as `pip install` writes one. The commands run as real processes (`real=True`): a fork
    of the suite's preloaded interpreter (tests/forked.py) has read the registry already, without the stand-in."""
    info = site / "label_text-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: label-text\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[hftrain.methods]\nlabel_text = label_text:ENTRY\n")
    return {"PYTHONPATH": os.pathsep.join([str(site), PLUGIN_DIR, REPO])}


def write_recipe(tmp_path, model_dir, **section) -> str:
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": f"{w} is {'good' if i % 2 else 'bad'}", "label": i % 2}) + "\n"
                            for i, w in enumerate(["tea", "rain", "sun", "mud", "cake", "ice", "wind", "fog"])))
    tree = {"model": {"name_or_path": model_dir, "dtype": "float32"},
            "data": {"sources": [{"path": str(data)}], "max_length": 16},
            "label_text": section,
            "training": {"output_dir": str(tmp_path / "out"), "max_steps": 1, "per_device_train_batch_size": 1,
                         "learning_rate": 1e-2, "save_strategy": "no", "disable_tqdm": True, "report_to": "none"}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def test_a_method_registered_from_outside_checks_and_trains_through_the_house(tmp_path, tiny_model_dir):
    env = installed_plugin(tmp_path / "site")
    helped = run([PY, "-m", "hftrain.cli", "--help"], env=env, real=True)
    assert helped.returncode == 0 and "label_text" in helped.stdout, helped.stdout + helped.stderr

    bad = run([PY, "-m", "hftrain.cli", "check", write_recipe(tmp_path, tiny_model_dir, text_column="label",
                                                               colour="red")], env=env, real=True)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "label_text.colour" in bad.stderr and "label_text.label_column" in bad.stderr, bad.stderr  # all at once

    recipe = write_recipe(tmp_path, tiny_model_dir)
    checked = run([PY, "-m", "hftrain.cli", "check", recipe], env=env, real=True)
    assert checked.returncode == 0 and "8 training texts" in checked.stdout + checked.stderr, checked.stderr[-3000:]

    trained = run([PY, "-m", "hftrain.cli", "label_text", recipe], env=env, real=True)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    out = tmp_path / "out"
    info = json.loads((out / "run_info.json").read_text())
    assert info["global_step"] == 1 and info["method"]["name"] == "label_text"
    assert info["method"]["head"] == "sequence_classification"
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForSequenceClassification"


BAD_PLUGINS = {  # entry-point name: (module source, what the refusal says)
    "broken": ("import no_such_package_here\n", "fails to import (ModuleNotFoundError"),
    "taken": ('from hftrain.methods.registry import MethodEntry\nENTRY = MethodEntry("grpo", "grpo", "mine", None, '
              '"x.y")\n', "registers method 'grpo', which is already registered"),
    "data": ('from hftrain.methods.registry import MethodEntry\nENTRY = MethodEntry("my_data", "my_data", "data", '
             'None, "x.y", "label_text.section:LabelTextSection")\n', "its section 'data' is the recipe's own"),
    "not_entry": ("ENTRY = 42\n", "it is int, not a hftrain.methods.registry.MethodEntry"),
}


def test_a_plugin_that_cannot_be_a_method_is_left_out_named_and_hftrain_works(tmp_path, tiny_model_dir):
    """A plugin that fails to import or registers a taken name made every command, --help included, end in a
    traceback; one declaring the section `data` silently replaced the recipe's own data: section. Each is left out
    with a line naming it and why; the commands, and a plain SFT recipe, work; the good plugin beside them too."""
    site = tmp_path / "site"
    env = installed_plugin(site)
    points = "".join(f"bad_{name} = bad_{name}:ENTRY\n" for name in BAD_PLUGINS)
    (site / "label_text-0.1.dist-info" / "entry_points.txt").write_text(
        "[hftrain.methods]\nlabel_text = label_text:ENTRY\n" + points)
    for name, (source, _) in BAD_PLUGINS.items():
        (site / f"bad_{name}.py").write_text(source)
    helped = run([PY, "-m", "hftrain.cli", "--help"], env=env, real=True)
    assert helped.returncode == 0 and "Traceback" not in helped.stderr, helped.stderr[-3000:]
    assert "label_text" in helped.stdout
    for name, (_, said) in BAD_PLUGINS.items():
        assert f"the method plugin bad_{name} = bad_{name}:ENTRY (hftrain.methods) is left out: " in helped.stderr
        assert said in helped.stderr, (name, helped.stderr)
    sft = tmp_path / "sft.yaml"
    demo = os.path.join(REPO, "data", "demo", "train.jsonl")
    sft.write_text(yaml.safe_dump({"model": {"name_or_path": tiny_model_dir}, "data": {"sources": [{"path": demo}]},
                                   "training": {"output_dir": str(tmp_path / "o")}}))
    checked = run([PY, "-m", "hftrain.cli", "check", str(sft)], env=env, real=True)
    assert checked.returncode == 0 and "Traceback" not in checked.stderr, checked.stderr[-3000:]
