import glob
import os

import pytest
import yaml

from hftrain.cli import main as cli_main
from hftrain.config import TRAINING_DEFAULTS, RecipeError, parse_overrides
from hftrain.methods import load_recipe
from hftrain.launch.setup import training_arguments

from .conftest import REPO

BASE = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}}


def write(tmp_path, tree, name="r.yaml") -> str:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(tree))
    return str(p)


def test_precedence_defaults_yaml_cli(tmp_path):
    tree = {**BASE, "data": {"sources": [{"path": "d.jsonl"}], "max_length": 128},
            "training": {"learning_rate": 1e-4, "logging_steps": 5}}
    r = load_recipe(write(tmp_path, tree), ["training.learning_rate=5e-4", "--training.max_steps", "7",
                                            "--data.packing=true"])
    assert r.data.max_length == 128  # YAML over default
    assert r.data.truncation == "right"  # default
    assert r.training["learning_rate"] == 5e-4  # CLI over YAML
    assert r.training["logging_steps"] == 5  # YAML over hftrain default
    assert r.training["max_steps"] == 7 and r.data.packing is True
    assert r.training["report_to"] == TRAINING_DEFAULTS["report_to"]


def test_cli_can_add_list_items_and_nested_sections():
    r = load_recipe(None, ["model.name_or_path=m", "data.sources.0.path=a.jsonl", "data.sources.1.path=b.jsonl",
                           "data.sources.1.weight=3", "model.lora.r=4"], raw={})
    assert [s.path for s in r.data.sources] == ["a.jsonl", "b.jsonl"]
    assert r.data.sources[1].weight == 3.0
    assert r.model.lora.r == 4 and r.model.lora.alpha == 32


def test_unknown_keys_all_listed_with_suggestions(tmp_path):
    tree = {"model": {"name_or_pth": "m"}, "data": {"sources": [{"path": "d", "weigth": 2}], "max_lenght": 3},
            "training": {"learning_rat": 1e-3}, "trainig": {}}
    path = write(tmp_path, tree)
    with pytest.raises(RecipeError) as e:
        load_recipe(path, ["training.max_step=3"])
    msg = str(e.value)
    for wrong, right in [("model.name_or_pth", "model.name_or_path"),
                         ("data.sources.0.weigth", "data.sources.0.weight"),
                         ("data.max_lenght", "data.max_length"), ("training.learning_rat", "training.learning_rate"),
                         ("trainig", "training")]:
        assert f"{path}: {wrong}: unknown key; did you mean '{right}'?" in msg
    assert "command line: training.max_step: unknown key; did you mean 'training.max_steps'?" in msg
    assert "model.name_or_path: required key is missing" in msg
    assert len(e.value.problems) == 7


def test_type_errors_name_key_type_and_value(tmp_path):
    tree = {**BASE, "data": {"sources": [{"path": "d"}], "max_length": "long", "packing": "yes"},
            "training": {"per_device_train_batch_size": 2.5, "lr_scheduler_type": "cosin"},
            "strategy": {"name": "zero4"}}
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, tree))
    msg = str(e.value)
    assert "data.max_length: expected int, got 'long'" in msg
    assert "data.packing: expected bool, got 'yes'" in msg
    assert "training.per_device_train_batch_size: expected int, got 2.5" in msg
    assert "training.lr_scheduler_type: expected one of 'linear', 'cosine'" in msg and "got 'cosin'" in msg
    assert "strategy.name: expected one of 'ddp'" in msg and "got 'zero4'" in msg
    assert len(e.value.problems) == 5


def test_yaml_1_1_exponent_floats_are_accepted(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("model: {name_or_path: m}\ndata: {sources: [{path: d}]}\ntraining: {learning_rate: 2e-5}\n")
    assert load_recipe(str(p)).training["learning_rate"] == 2e-5


def test_non_finite_numbers_are_refused_where_a_number_is_expected(tmp_path):
    """YAML's .nan and .inf are floats: a router bias rate of .nan trained and saved NaN biases (issue 64). Every
    number of the recipe must be finite, named with its key, all at once; a finite one is the control."""
    p = tmp_path / "r.yaml"
    p.write_text("model: {name_or_path: m}\ndata: {sources: [{path: d}]}\nmoe: {bias_update_rate: .nan}\n"
                 "training: {max_grad_norm: .inf, weight_decay: -.inf}\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(str(p))
    msg = str(e.value)
    assert "moe.bias_update_rate: expected a finite number or null, got nan" in msg
    assert "training.max_grad_norm: expected a finite number" in msg and "got inf" in msg
    assert "training.weight_decay: expected a finite number" in msg and "got -inf" in msg
    assert len(e.value.problems) == 3  # once each: the range rules do not judge them again
    assert load_recipe(None, ["moe.bias_update_rate=0.001"], raw=dict(BASE)).moe.bias_update_rate == 0.001


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  name_or_path: m\ndata: [unclosed\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(str(p))
    assert f"{p}:4:1: YAML syntax error" in str(e.value)


def test_semantic_rules(tmp_path):
    tree = {**BASE, "data": {"sources": [{"path": "d", "weight": 0}], "eval_fraction": 1.5,
                             "eval_sources": [{"path": "e"}, {"path": "e", "weight": 2}]},
            "training": {"eval_strategy": "steps"}, "eval": {"exact_match": 5}}
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, tree))
    msg = str(e.value)
    assert "data.sources.0.weight: must be a finite number > 0" in msg
    assert "data.eval_fraction: must be in [0, 1)" in msg
    assert "data.eval_sources.1.weight: held-out sources are each evaluated whole" in msg
    assert "data.eval_sources.0.weight" not in msg


def test_token_and_owned_fields_refused():
    with pytest.raises(RecipeError) as e:
        load_recipe(None, ["training.hub_token=hf_secret", "training.gradient_checkpointing=true",
                           "training.average_tokens_across_devices=false", "training.use_liger_kernel=true",
                           "training.deepspeed=ds.json"],
                    raw=dict(BASE))
    assert "training.hub_token: not accepted here" in str(e.value)
    assert "set model.gradient_checkpointing instead" in str(e.value)
    assert "training.average_tokens_across_devices: not accepted here" in str(e.value)
    assert "training.use_liger_kernel: not accepted here" in str(e.value)
    assert "training.deepspeed: not accepted here: set strategy.name" in str(e.value)


def test_loss_averaging_key():
    assert load_recipe(None, [], raw=dict(BASE)).training["loss_averaging"] == "token"
    assert (load_recipe(None, ["training.loss_averaging=sequence"], raw=dict(BASE)).training["loss_averaging"]
            == "sequence")
    with pytest.raises(RecipeError, match="training.loss_averaging: expected one of 'token', 'sequence', got 'tokens'"):
        load_recipe(None, ["training.loss_averaging=tokens"], raw=dict(BASE))
    args = training_arguments(load_recipe(None, ["training.loss_averaging=sequence"], raw=dict(BASE)))
    assert args.loss_averaging == "sequence"  # typed end to end: the trainer reads it from its arguments


def test_run_set_options_are_refused_in_training():
    """strategy_name and compression are arguments the run fills in from strategy: and compression:."""
    with pytest.raises(RecipeError) as e:
        load_recipe(None, ["training.strategy_name=ddp", "training.compression={method: fp16}"], raw=dict(BASE))
    assert "training.strategy_name: not accepted here: set strategy.name" in str(e.value)
    assert "training.compression: not accepted here: set the compression: section" in str(e.value)


def test_override_syntax_errors():
    with pytest.raises(RecipeError, match="is not an override"):
        parse_overrides(["training.max_steps"])
    with pytest.raises(RecipeError, match="has no value"):
        parse_overrides(["--training.max_steps"])


def test_training_arguments_are_built_and_validated():
    r = load_recipe(None, ["training.max_steps=3", "training.output_dir=/tmp/x", "model.gradient_checkpointing=true"],
                    raw=dict(BASE))
    args = training_arguments(r)
    assert args.max_steps == 3 and args.activation_checkpointing is True
    assert args.report_to == ["tensorboard"]
    assert args.ddp_find_unused_parameters is False


def test_resolved_recipe_round_trips(tmp_path):
    r = load_recipe(None, ["training.max_steps=3", "data.packing=true"], raw=dict(BASE))
    again = load_recipe(write(tmp_path, r.to_dict()))
    assert again.to_dict() == r.to_dict()


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "recipes", "**", "*.yaml"), recursive=True)))
def test_every_shipped_recipe_parses(path):
    r = load_recipe(path)
    assert r.model.name_or_path and r.data.sources


def test_shipped_recipes_exist():
    assert glob.glob(os.path.join(REPO, "recipes", "**", "*.yaml"), recursive=True)


def test_cli_check_prints_resolved_recipe(tmp_path, capsys):
    assert cli_main(["check", write(tmp_path, BASE), "training.max_steps=9", "--no-data"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["training"]["max_steps"] == 9 and out["data"]["max_length"] == 2048


def test_cli_check_reports_errors_with_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["check", write(tmp_path, BASE), "training.max_stepz=9"])
    assert e.value.code == 2
    assert "did you mean 'training.max_steps'" in capsys.readouterr().err
