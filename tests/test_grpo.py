"""GRPO (recipes/grpo.py), fast: the `grpo:` section's rules, prompts from every layout with row-named refusals, the
reward functions and their errors (before the model loads), `hftrain data`, the launch and the model card. The runs
are in tests/test_grpo_runs.py."""

import json
import os
import sys

import pytest
import yaml

from hftrain.config import DataSection, DataSource
from hftrain.methods import GrpoSection, RewardSpec, load_recipe, parse_recipe
from hftrain.methods.grpo.prompts import read_prompts
from hftrain.errors import DataError, RecipeError, RewardError
from hftrain.methods.grpo.rewards import Reward, dry_run, exact_match, load_rewards

from .conftest import DEMO_TRAIN, REPO

BASE = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]},
        "grpo": {"rewards": [{"function": "exact_match"}]}}


def problems(*overrides, tree=None):
    return parse_recipe(None, list(overrides), raw=json.loads(json.dumps(tree or BASE)))[1]


# -- the grpo: section -------------------------------------------------------------------------------------------
def test_shipped_recipe_parses():
    recipe, found = parse_recipe(os.path.join(REPO, "recipes", "demo", "grpo.yaml"))
    assert found == [] and recipe.grpo.rewards[0].function == "exact_match" and recipe.grpo.loss_type == "dapo"


@pytest.mark.parametrize("override, expected", [
    ("grpo.num_generations=1", "grpo.num_generations: must be at least 2"),
    ("grpo.loss_type=bnpo", "grpo.loss_type: expected one of 'grpo', 'dr_grpo', 'dapo'"),
    ("grpo.beta=-0.1", "grpo.beta: must be a finite number >= 0, got -0.1"),
    ("grpo.epsilon=0.1", "grpo.epsilon: clips the probability ratio to the policy that generated, which is 1"),
    ("grpo.temperature=0", "grpo.temperature: must be a finite number > 0"),
    ("grpo.rewards.0.function=foo", "grpo.rewards.0.function: 'foo' is neither a built-in"),
    ("grpo.rewards.0.pattern=x", "grpo.rewards.0.pattern: applies to function regex, not 'exact_match'"),
    ("grpo.rewards.0.function=regex", "grpo.rewards.0.pattern: function regex needs the pattern"),
    ("grpo.rewards.0.limit=3", "grpo.rewards.0.limit: applies to function length_penalty"),
    ("grpo.max_completion_length=4096", "data.max_length: bounds prompt + completion and must exceed"),
    ("data.packing=true", "data.packing: applies to supervised fine-tuning, not to GRPO"),
    ("data.sources.0.format=text", "data.sources.0.format: text rows hold no prompt to answer"),
    ("training.eval_strategy=steps", "training.eval_strategy: GRPO is judged by eval.exact_match"),
    ("training.loss_impl=chunked", "training.loss_impl: applies to supervised fine-tuning"),
    ("training.loss_impl=fused", "training.loss_impl: applies to supervised fine-tuning"),
    ("training.train_sampling_strategy=group_by_length", "training.train_sampling_strategy: GRPO samples prompts"),
    ("training.include_num_input_tokens_seen=all", "training.include_num_input_tokens_seen: GRPO's batches"),
    ("model.lora.target_modules=[lm_head]", "model.lora: GRPO computes log-probs from lm_head's weight"),
    ("model.lora.target_modules=.*", "model.lora: GRPO computes log-probs from lm_head's weight"),
    ("preference.beta=0.1", "grpo: a recipe trains one method"),
    ("strategy.name=zero1", "strategy.name: GRPO runs under ddp, fsdp, zero2, zero3"),
])
def test_config_errors_name_the_key_and_the_fix(override, expected):
    found = problems(override)
    assert any(expected in p for p in found), found


def test_all_problems_at_once_and_the_valid_ones_pass():
    found = problems("grpo.num_generations=1", "grpo.rewards.0.function=regex", "grpo.rewards.1.function=x:1y",
                     "grpo.rewards.1.pattern=(")
    assert len(found) == 5, found  # group size, missing pattern, bad name, pattern on a non-regex, bad regex
    assert any("grpo.rewards.1.pattern: is not a regular expression" in p for p in found)
    assert problems("grpo.num_iterations=2", "grpo.epsilon=0.1", "grpo.epsilon_high=0.28", "grpo.beta=0.04",
                    "grpo.rewards.1.function=regex", "grpo.rewards.1.pattern=[a-j ]+",
                    "grpo.rewards.2.function=length_penalty", "grpo.rewards.2.limit=8",
                    "grpo.rewards.3.function=my_rewards:score") == []


def test_a_group_size_that_does_not_divide_the_batch_is_refused_at_check(tmp_path):
    from hftrain.launch import check_recipe

    tree = {**BASE, "training": {"output_dir": str(tmp_path / "o"), "per_device_train_batch_size": 3}}
    with pytest.raises(RecipeError) as e:
        check_recipe(None, ["grpo.num_generations=4"], raw=tree, environment=False)
    assert ("grpo.num_generations: 4 does not divide the global batch of 6 completions (2 processes x "
            "per_device_train_batch_size 3 x gradient_accumulation_steps 1)") in str(e.value)
    check_recipe(None, ["grpo.num_generations=3"], raw=tree, environment=False)
    check_recipe(None, ["grpo.num_generations=4", "training.gradient_accumulation_steps=2"], raw=tree,
                 environment=False)


# -- prompts from every layout -------------------------------------------------------------------------------------
def write(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompts_of(tmp_path, tokenizer, rows, **data):
    src = DataSource(path=str(write(tmp_path, rows)), **data.pop("source", {}))
    cfg = DataSection(sources=[src], max_length=64, **data)
    return read_prompts(src, "data.sources.0", tokenizer, cfg, 16, needs_reference="exact_match")


def test_prompts_from_each_layout_are_the_turns_before_the_answer(tmp_path, tokenizer):
    user = lambda t: {"role": "user", "content": t}  # noqa: E731
    bot = lambda t: {"role": "assistant", "content": t}  # noqa: E731
    rows = prompts_of(tmp_path, tokenizer, [{"messages": [user("a"), bot("b"), user("c"), bot("d")]}])
    assert [r for _, r, _ in rows] == [{"prompt": [user("a"), bot("b"), user("c")], "reference": "d"}]
    rows = prompts_of(tmp_path, tokenizer, [{"conversations": [{"from": "human", "value": "q"},
                                                               {"from": "gpt", "value": "a"}]}])
    assert [r for _, r, _ in rows] == [{"prompt": [user("q")], "reference": "a"}]
    rows = prompts_of(tmp_path, tokenizer, [{"question": "2+2=", "answer": "4"}],
                      source={"columns": {"prompt": "question", "completion": "answer"}})
    assert [r for _, r, _ in rows] == [{"prompt": "2+2=", "reference": "4"}]
    rows = prompts_of(tmp_path, tokenizer, [{"instruction": "add", "input": "2 2", "output": "4"}])
    assert [r for _, r, _ in rows] == [{"prompt": [user("add\n\n2 2")], "reference": "4"}]


@pytest.mark.parametrize("bad, message", [
    ({"text": "just text"}, "mixed layouts"),
    ({"prompt": None, "completion": "4"}, "prompt is null where text is expected"),
    ({"prompt": " ", "completion": "4"}, "the prompt is empty"),
    ({"messages": [{"role": "user", "content": "q"}]}, "has no reference answer (the conversation ends on a user"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "the conversation has no turn before the answer"),
    ({"prompt": "reverse: " + "a " * 60, "completion": "a"}, "the prompt is 6"),
])
def test_bad_rows_are_refused_naming_file_and_line(tmp_path, tokenizer, bad, message):
    good = {"prompt": "reverse: a b", "completion": "b a"}
    if "messages" in bad:
        good = {"messages": [{"role": "user", "content": "reverse: a b"}, {"role": "assistant", "content": "b a"}]}
    with pytest.raises(DataError) as e:
        prompts_of(tmp_path, tokenizer, [good, good, bad])
    assert f"data.sources.0: {tmp_path / 'd.jsonl'}:3: " in str(e.value) and message in str(e.value), str(e.value)


def test_too_long_prompts_are_dropped_with_truncation_drop_and_answerless_ones_kept_without_exact_match(
        tmp_path, tokenizer):
    rows = [{"prompt": "reverse: a b", "completion": "b a"}, {"prompt": "reverse: " + "a " * 60, "completion": "a"}]
    kept = prompts_of(tmp_path, tokenizer, rows, truncation="drop")
    assert [r["prompt"] for _, r, _ in kept] == ["reverse: a b"]
    src = DataSource(path=str(write(tmp_path, [{"messages": [{"role": "user", "content": "q"}]}])))
    (_, row, n), = read_prompts(src, "data.sources.0", tokenizer, DataSection(sources=[src], max_length=64), 16)
    assert row == {"prompt": [{"role": "user", "content": "q"}], "reference": None} and n > 0


def test_a_missing_prompt_column_is_refused_by_hftrain_check(tmp_path, tiny_model_dir, capsys):
    from hftrain.cli import main as cli_main

    data = write(tmp_path, [{"completion": "4"}, {"completion": "5"}])
    rec = write_recipe(tmp_path, tiny_model_dir, data)
    with pytest.raises(SystemExit) as e:
        cli_main(["check", str(rec), "data.sources.0.format=prompt_completion"])
    assert e.value.code == 2
    assert "format 'prompt_completion' needs column(s) ['prompt']" in capsys.readouterr().err


def test_an_eval_fraction_that_leaves_a_source_no_training_row_is_refused_by_check_and_the_run_alike(
        tmp_path, tiny_model_dir, capsys):
    """The prompts hold rows out by the rule every method uses (data/split.py): datasets' bare ValueError was a
    traceback (exit 1) from the run and from check."""
    from hftrain.cli import main as cli_main
    from hftrain.errors import exit_on_user_error
    from hftrain.recipes import grpo

    data = write(tmp_path, [{"prompt": f"reverse: {c} ->", "completion": f" {c}"} for c in "ab"])
    argv = [str(write_recipe(tmp_path, tiny_model_dir, data)), "data.eval_fraction=0.9", "strategy.num_processes=1"]
    expected = (f"hftrain: error: data.eval_fraction: 0.9 of the 2 rows of data.sources.0 ({data}) leaves no row to "
                "train on; change data.eval_fraction or add rows")
    errors = []
    for run in (lambda: cli_main(["check", *argv]), lambda: grpo.main(argv)):
        with pytest.raises(SystemExit) as e, exit_on_user_error():
            run()
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err and expected in err, err[-3000:]
        errors.append(err[err.index("hftrain: error:"):])
    assert errors[0] == errors[1]


# -- reward functions ----------------------------------------------------------------------------------------------
def test_builtin_rewards(tokenizer):
    g = GrpoSection(rewards=[RewardSpec("exact_match"), RewardSpec("regex", pattern="[a-j]( [a-j])*"),
                             RewardSpec("length_penalty", limit=2), RewardSpec("regex", pattern="x")],
                    max_completion_length=10)
    em, rx, lp, rx2 = load_rewards(g)
    assert [f.__name__ for f in (em, rx, lp, rx2)] == ["exact_match", "regex", "length_penalty", "regex_2"]
    conv = lambda t: [{"role": "assistant", "content": t}]  # noqa: E731
    args = dict(prompts=["p"] * 3, completions=[conv(" b a "), conv("b, a"), conv("")], reference=["b a", "b a", None],
                completion_ids=[[1, 2, 3], [1], []])
    assert em(**args) == [1.0, 0.0, None]
    assert rx(**args) == [1.0, 0.0, 0.0]
    assert lp(**args) == [-0.1, 0.0, 0.0]


def bad_rewards(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def raises(prompts, completions, **kw):\n    return [1 / 0 for _ in completions]\n"
        "def short(prompts, completions, **kw):\n    return [1.0]\n"
        "def text(prompts, completions, **kw):\n    return ['1.0' for _ in completions]\n"
        "def nan(prompts, completions, **kw):\n    return [float('nan') for _ in completions]\n"
        "def scalar(prompts, completions, **kw):\n    return 1.0\n"
        "def good(prompts, completions, reference, **kw):\n"
        "    return [float(len(c[0]['content'])) for c in completions]\n")
    return tmp_path / "my_rewards.py"


@pytest.mark.parametrize("name, message", [
    ("raises", "grpo.rewards.0 (raises) raised ZeroDivisionError: division by zero (at "),
    ("short", "grpo.rewards.0 (short) returned 1 values for 8 completions"),
    ("text", "grpo.rewards.0 (text) returned '1.0' (str) for completion 0; each value must be a finite number"),
    ("nan", "grpo.rewards.0 (nan) returned nan (float) for completion 0"),
    ("scalar", "grpo.rewards.0 (scalar) returned float '1.0'; return a list of one number per completion (8)"),
])
def test_a_bad_reward_function_is_one_error_naming_it(tmp_path, tokenizer, name, message):
    path = bad_rewards(tmp_path)
    rows = [{"prompt": [{"role": "user", "content": "q"}], "reference": "a"}] * 4
    with pytest.raises(RewardError) as e:
        dry_run(load_rewards(GrpoSection(rewards=[RewardSpec(f"{path}:{name}")])), rows, tokenizer)
    assert message in str(e.value), str(e.value)
    if name == "raises":
        assert f"{path}:2)" in str(e.value)  # the line that raised
    dry_run(load_rewards(GrpoSection(rewards=[RewardSpec(f"{path}:good")])), rows, tokenizer)


def test_deferred_errors_are_kept_for_every_rank_to_raise():
    reward = Reward(lambda prompts, completions, **kw: [1.0], "short", "grpo.rewards.0", defer=True)
    assert reward(prompts=["p", "p"], completions=["a", "b"]) == [None, None]
    assert "returned 1 values for 2 completions" in reward.error


def test_reward_functions_that_cannot_be_imported(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad_rewards(tmp_path)
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    cases = [("my_rewards:missing", "grpo.rewards.0.function: my_rewards has no function 'missing'"),
             ("no_such_mod:f", "grpo.rewards.0.function: cannot import no_such_mod: ModuleNotFoundError"),
             ("broken:f", "cannot import broken: ModuleNotFoundError: No module named 'no_such_module_here' (at "),
             ("nowhere.py:f", "grpo.rewards.0.function: nowhere.py does not exist")]
    for spec, message in cases:
        with pytest.raises(RewardError) as e:
            load_rewards(GrpoSection(rewards=[RewardSpec(spec)]))
        assert message in str(e.value), str(e.value)
    assert load_rewards(GrpoSection(rewards=[RewardSpec("my_rewards:good")]))[0].__name__ == "good"
    assert exact_match(["p"], ["x"], ["x"]) == [1.0]


def test_a_reward_that_never_returns_stops_within_its_time_limit_naming_it(tokenizer):
    import time

    def stuck(prompts, completions, **kw):
        while time.monotonic() - start < 60:  # a tool that never answers (ends after 60 s: without the limit the
            time.sleep(0.05)                  # test fails instead of hanging)
        return [1.0] * len(completions)

    start = time.monotonic()
    with pytest.raises(RewardError) as e:
        Reward(stuck, "stuck", "grpo.rewards.1", timeout=0.5)(prompts=["p"], completions=["a"])
    # interrupted: far below the 60 s the call takes by itself, whatever the machine's load
    assert time.monotonic() - start < 30
    assert str(e.value) == ("grpo.rewards.1 (stuck) did not return within grpo.reward_timeout=0.5 s (for 1 "
                            "completions); make it faster, or raise grpo.reward_timeout (0: no limit)")
    # a regular expression stuck backtracking is interrupted too (sre checks for signals)
    backtracking = load_rewards(GrpoSection(rewards=[RewardSpec("regex", pattern="(a+)+$")], reward_timeout=0.5))
    with pytest.raises(RewardError, match="did not return within grpo.reward_timeout=0.5 s"):
        backtracking[0](prompts=["p"], completions=["a" * 40 + "b"])
    import signal
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL  # the handler is put back
    assert problems("grpo.reward_timeout=-1") == ["command line: grpo.reward_timeout: must be a finite number of "
                                                     "seconds >= 0 (0: no limit), got -1.0"]


def test_each_reward_gets_its_own_copy_of_the_inputs_and_prints_on_stderr(capsys):
    seen = []

    def editor(prompts, completions, reference, **kw):
        print("debugging a reward")
        completions[0][0]["content"] = "edited"
        reference[0] = "edited"
        prompts.clear()
        return [0.0] * len(completions)

    def reader(prompts, completions, reference, **kw):
        seen.append((prompts, completions, reference))
        return [0.0] * len(completions)

    completions = [[{"role": "assistant", "content": "a"}]]
    kwargs = {"prompts": [[{"role": "user", "content": "q"}]], "completions": completions, "reference": ["r"]}
    for fn in (editor, reader):
        Reward(fn, fn.__name__, "grpo.rewards.0")(**kwargs)
    assert seen == [([[{"role": "user", "content": "q"}]], [[{"role": "assistant", "content": "a"}]], ["r"])]
    assert completions[0][0]["content"] == "a"  # TRL's own lists (it logs them) are untouched too
    out = capsys.readouterr()
    assert out.out == "" and "debugging a reward" in out.err


def test_a_reward_module_that_exits_or_prints_at_import(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exits.py").write_text("import sys\nprint('loading rewards')\nsys.exit(0)\n")
    (tmp_path / "chatty.py").write_text("print('loading rewards')\ndef f(prompts, completions, **kw):\n"
                                        "    return [1.0] * len(completions)\n")
    with pytest.raises(RewardError) as e:
        load_rewards(GrpoSection(rewards=[RewardSpec("exits:f")]))
    assert str(e.value).startswith("grpo.rewards.0.function: importing exits called sys.exit(0) (at ")
    assert "a module must not exit" in str(e.value)
    with pytest.raises(RewardError, match=r"grpo.rewards.0 \(quits\) called sys.exit\(3\)"):
        Reward(lambda **kw: sys.exit(3), "quits", "grpo.rewards.0")(prompts=["p"], completions=["a"])
    assert load_rewards(GrpoSection(rewards=[RewardSpec("chatty:f")]))[0].__name__ == "f"
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("loading rewards") == 2


# -- the commands --------------------------------------------------------------------------------------------------
def write_recipe(tmp_path, model, data, **grpo):
    tree = {"model": {"name_or_path": model}, "data": {"sources": [{"path": str(data)}], "max_length": 64},
            "grpo": {"rewards": [{"function": "exact_match"}], "num_generations": 2, "max_completion_length": 16,
                     **grpo},
            "training": {"output_dir": str(tmp_path / "o"), "per_device_train_batch_size": 2}}
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump(tree))
    return rec


def test_hftrain_check_runs_the_reward_functions_before_loading_the_model(tmp_path, tiny_model_dir, capsys):
    from hftrain.cli import main as cli_main

    rec = write_recipe(tmp_path, tiny_model_dir, DEMO_TRAIN, rewards=[
        {"function": "exact_match"}, {"function": f"{bad_rewards(tmp_path)}:text"}])
    with pytest.raises(SystemExit) as e:
        cli_main(["check", str(rec)])
    assert e.value.code == 2
    assert "grpo.rewards.1 (text) returned '1.0' (str) for completion 0" in capsys.readouterr().err


def test_hftrain_data_shows_the_prompts_as_the_policy_receives_them(tmp_path, tiny_model_dir, capsys):
    from hftrain.cli import main as cli_main

    assert cli_main(["data", str(write_recipe(tmp_path, tiny_model_dir, DEMO_TRAIN)), "--examples", "1"]) == 0
    out = capsys.readouterr().out
    first = json.loads(open(DEMO_TRAIN).readline())["messages"]
    assert f"data.sources.0 ({DEMO_TRAIN}): 4000 prompts, 4000 with a reference answer" in out
    assert f"<|im_start|>user\n{first[0]['content']}<|im_end|>\n<|im_start|>assistant\n" in out
    assert f"reference: {first[1]['content']!r}" in out


def test_launch_picks_the_grpo_module_and_the_other_scripts_refuse_the_recipe(tmp_path, tiny_model_dir, capsys):
    from hftrain.cli import main as cli_main
    from hftrain.launch.setup import setup_run

    rec = write_recipe(tmp_path, tiny_model_dir, DEMO_TRAIN)
    for cmd in (["launch", "--dry-run", str(rec)], ["grpo", "--dry-run", str(rec)]):
        assert cli_main(cmd) == 0
        assert "-m hftrain.recipes.grpo" in capsys.readouterr().out
    tree = yaml.safe_load(rec.read_text())
    for script in ("sft", "dpo"):
        with pytest.raises(RecipeError) as e:
            setup_run([], script, raw=tree)
        assert "this recipe has a grpo: section: run it with `hftrain grpo` (recipes/grpo.py)" in str(e.value)


def test_the_model_card_names_the_grpo_stage(tmp_path):
    """The method as the run records it in run_info.json (lifecycle: Method.card) is what the card says."""
    from hftrain.hub.card import build_card
    from hftrain.methods import method_of

    tree = {"model": {"name_or_path": "runs/demo/sft"}, "data": {"sources": [{"path": "d.jsonl"}]},
            "grpo": {"rewards": [{"function": "exact_match"}, {"function": "regex", "pattern": "a+"}],
                     "loss_type": "dapo", "num_generations": 8, "beta": 0.0}}
    recipe = load_recipe(None, raw=tree)
    (tmp_path / "recipe.yaml").write_text(recipe.to_yaml())
    (tmp_path / "run_info.json").write_text(json.dumps({"method": method_of(recipe).card(recipe)}))
    card = str(build_card(str(tmp_path), os.listdir(tmp_path)))
    assert "trained by GRPO (dapo loss, groups of 8, beta=0.0, rewards: exact_match, regex) with hftrain" in card
    assert "- grpo" in card


def test_vllm_generation_is_refused_where_vllm_cannot_run(tmp_path, tiny_model_dir):
    import importlib.util

    from hftrain.distributed import accelerator_available
    from hftrain.launch import check_recipe

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")

    tree = {**BASE, "model": {"name_or_path": tiny_model_dir}, "training": {"output_dir": str(tmp_path / "o")},
            "grpo": {**BASE["grpo"], "num_generations": 2, "generation": "vllm"}}
    with pytest.raises(RecipeError) as e:
        check_recipe(None, [], raw=tree)
    assert "grpo.generation: vllm is not installed here: `pip install vllm`" in str(e.value)
    assert ("grpo.generation: vllm generates on a GPU and there is none on this machine" in str(e.value)) == (
        not accelerator_available())
