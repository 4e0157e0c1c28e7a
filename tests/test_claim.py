"""output_dir is claimed, then checked, under the lock, and it is one folder for every part of a run (issue 33,
point 2): a run whose folder another run finished during its data phase is refused at the claim, having written
nothing; `~`, variables and relative paths are resolved once, when the recipe is read, so that the lock, the checks,
the saves and the Trainer's own output_dir are the same folder."""

import os

import pytest
import yaml

from hftrain import lifecycle, outdir
from hftrain.methods import load_recipe
from hftrain.launch import setup_run
from hftrain.methods import sft

from .conftest import DEMO_TRAIN
from .test_bad_input import W, run_main, set_


def _finish_a_run_in(out: str) -> None:
    """What another run leaves when it finishes (its lock released): the files the ownership check reads."""
    for name in ("recipe.yaml", "model.safetensors", "run_info.json", "checkpoint-3/trainer_state.json"):
        os.makedirs(os.path.dirname(os.path.join(out, name)), exist_ok=True)
        with open(os.path.join(out, name), "w") as fh:
            fh.write(f"the other run's {name}")


def test_a_run_whose_folder_another_run_finished_during_its_data_phase_is_refused(tmp_path, tiny_model_dir,
                                                                                    monkeypatch, capsys):
    """Run B passes its preflight on a new folder; during B's data phase run A finishes in that folder; B must be
    refused at its claim (exit 2, one message) and A's files stay byte for byte as A left them."""
    w = W(str(tmp_path), tiny_model_dir)
    real_check_data = lifecycle.check_data  # the data phase (lifecycle.read_data)

    def slow_data_phase(*args, **kwargs):
        result = real_check_data(*args, **kwargs)
        _finish_a_run_in(w.out)  # the other run finishes while this one tokenises
        return result

    monkeypatch.setattr(lifecycle, "check_data", slow_data_phase)
    state = {}
    monkeypatch.setattr(sft, "load_model", lambda *a, **k: state.setdefault("loaded", True) and None)
    code = run_main([w.recipe(set_("training.save_strategy", "no"))], {}, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert err.count("hftrain: error:") == 1 and "holds a finished run (run_info.json)" in err, err[-3000:]
    assert "loaded" not in state  # refused before the model loads
    assert sorted(os.listdir(w.out)) == ["checkpoint-3", "model.safetensors", "recipe.yaml", "run_info.json"]
    assert open(os.path.join(w.out, "recipe.yaml")).read() == "the other run's recipe.yaml"
    assert not os.path.exists(os.path.join(w.out, outdir.LOCK_FILE))


@pytest.fixture
def home(tmp_path, monkeypatch):
    """$HOME in tmp_path, and the working folder elsewhere, so that `~/x` and `./~/x` are told apart."""
    h, cwd = tmp_path / "home", tmp_path / "cwd"
    h.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(h))
    monkeypatch.chdir(cwd)
    return h


@pytest.mark.parametrize("written, where", [("~/run", "home/run"), ("$HOME/run", "home/run"),
                                            ("${RUNS}/a", "runs/a"), ("rel/run", "cwd/rel/run")])
def test_output_dir_is_resolved_once_and_the_trainer_uses_it(written, where, home, tmp_path, tiny_model_dir,
                                                             monkeypatch):
    monkeypatch.setenv("RUNS", str(tmp_path / "runs"))
    w = W(str(tmp_path), tiny_model_dir)
    recipe_path = w.recipe(set_("training.output_dir", written))
    run = setup_run([recipe_path])
    expected = str(tmp_path / where)
    assert run.recipe.output_dir == expected and run.args.output_dir == expected
    assert run.recipe.to_dict()["training"]["output_dir"] == expected  # recipe.yaml records the folder used


def test_home_written_as_tilde_is_refused(home, tmp_path, tiny_model_dir, monkeypatch, capsys):
    w = W(str(tmp_path), tiny_model_dir)
    for written in ("~", "~/", "$HOME"):
        code = run_main([w.recipe(set_("training.output_dir", written))], {}, monkeypatch)
        err = capsys.readouterr().err
        assert code == 2 and f"training.output_dir: {home} is your home folder" in err, err[-2000:]
    assert os.listdir(home) == [] and os.listdir(tmp_path / "cwd") == []
    code = run_main([w.recipe(), "training.output_dir=~"], {}, monkeypatch)  # YAML: a bare ~ is null
    assert code == 2 and "YAML reads a bare ~ as null" in capsys.readouterr().err


def test_an_unset_variable_in_a_path_is_refused():
    from hftrain.config import RecipeError

    with pytest.raises(RecipeError, match=r"training.output_dir: \$HFTRAIN_NO_SUCH_VAR/run: the environment "
                                          r"variable \$HFTRAIN_NO_SUCH_VAR is not set"):
        load_recipe(None, ["model.name_or_path=m", f"data.sources.0.path={DEMO_TRAIN}",
                           "training.output_dir=$HFTRAIN_NO_SUCH_VAR/run"])


@pytest.mark.launches
def test_a_run_into_tilde_keeps_everything_in_one_folder(home, tmp_path, tiny_model_dir, monkeypatch, capsys):
    """The whole run, checkpoints included, lands in $HOME/run under the lock; nothing in a literal ./~ folder."""
    w = W(str(tmp_path), tiny_model_dir)
    recipe_path = w.recipe(lambda t: t["training"].update(output_dir="~/run", max_steps=2, save_steps=1,
                                                           save_strategy="steps"))
    code = run_main([recipe_path], {}, monkeypatch)
    assert code in (0, None), capsys.readouterr().err[-3000:]
    out = home / "run"
    names = set(os.listdir(out))
    assert {"model.safetensors", "run_info.json", "recipe.yaml", ".hftrain.lock", "checkpoint-1",
            "checkpoint-2"} <= names
    assert yaml.safe_load((out / "recipe.yaml").read_text())["training"]["output_dir"] == str(out)
    assert os.listdir(tmp_path / "cwd") == []
    outdir.release(str(out))
