"""`hftrain eval` (hftrain/harness/, cli/eval_command.py): lm-evaluation-harness, offline, on a model and its base.

The oracle for the held-out task is hftrain's own eval.exact_match (evaluate.py): rows whose references are a
model's own greedy answers (for some rows) give the harness's exact match the share hftrain counts, so a prompt
rendered, cut or decoded differently by the harness would show. The gate is tested both ways on two models that
answer differently."""

import importlib.util
import json
import os
import shutil

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from hftrain.cli import main
from hftrain.evaluate import exact_match, greedy_answer
from hftrain.harness import TASK
from hftrain.hub.card import build_card

from .conftest import DEMO_EVAL
from .support import scrambled

# Not imported here: lm-eval's import sets HF_XET_HIGH_PERFORMANCE, which at collection time would outlive every
# test of this worker (conftest._environment_put_back puts back what a test changes, not what collection did).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed")

ROWS = 12
MAX_NEW_TOKENS = 6


def prompts() -> list[dict]:
    with open(DEMO_EVAL, encoding="utf-8") as f:
        return [json.loads(line) for line in f][:ROWS]


def answers(model_dir) -> list[str]:
    """The model's greedy answers to the prompts, as hftrain's eval.exact_match generates them."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [greedy_answer(model, tokenizer, {"messages": row["messages"][:1]}, MAX_NEW_TOKENS) for row in prompts()]


def rows_file(path, references: list[str]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row, reference in zip(prompts(), references):
            f.write(json.dumps({"messages": [row["messages"][0], {"role": "assistant", "content": reference}]}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def two_models(tiny_model_dir, tmp_path_factory) -> tuple[str, str]:
    """(a base, another model): two models that answer the prompts differently."""
    return tuple(scrambled(tiny_model_dir, str(tmp_path_factory.mktemp(f"model{seed}")), seed) for seed in (0, 1))


def evaluated(argv, capsys) -> tuple[int, str, str]:
    code = main(["eval", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_harness_counts_the_held_out_exact_match_as_hftrain_does(two_models, tmp_path, capsys):
    base, other_model = two_models
    own = answers(other_model)
    base_answers = answers(base)
    assert sum(a != b for a, b in zip(own, base_answers)) >= ROWS // 2, "the two models must answer differently"
    # Every third row's reference is the model's own answer, the rest a wrong one.
    references = [a if i % 3 == 0 else "no such answer" for i, a in enumerate(own)]
    path = rows_file(tmp_path / "rows.jsonl", references)
    model = AutoModelForCausalLM.from_pretrained(other_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(other_model)
    examples = [{"messages": [r["messages"][0]], "reference": ref} for r, ref in zip(prompts(), references)]
    hftrains = exact_match(model, tokenizer, examples, MAX_NEW_TOKENS)
    assert hftrains == pytest.approx(4 / ROWS)

    code, out, _ = evaluated([other_model, "--rows", path, "--max-new-tokens", str(MAX_NEW_TOKENS), "--no-base",
                              "--output", str(tmp_path / "alone.json")], capsys)
    assert code == 0, out
    [alone] = json.loads((tmp_path / "alone.json").read_text())["comparisons"]
    assert (alone["task"], alone["metric"], alone["base"]) == (TASK, "exact_match,none", None)
    assert alone["trained"] == pytest.approx(hftrains)


def test_the_gate_passes_an_improvement_and_fails_a_regression(two_models, tmp_path, capsys):
    base, other_model = two_models
    path = rows_file(tmp_path / "rows.jsonl", answers(other_model))  # the other model's answers: it scores 1
    common = ["--rows", path, "--max-new-tokens", str(MAX_NEW_TOKENS)]
    code, out, err = evaluated([other_model, "--base", base, "--min-delta", "0.5", *common,
                                "--output", str(tmp_path / "better.json")], capsys)
    assert code == 0, out + err
    [better] = json.loads((tmp_path / "better.json").read_text())["comparisons"]
    assert better["trained"] == 1.0 and better["base"] < 0.5 and better["improvement"] > 0.5
    assert f"| {TASK} | exact_match,none | {better['base']:.4f} | 1.0000 |" in out

    code, out, err = evaluated([base, "--base", other_model, "--min-delta", "0", *common,
                                "--output", str(tmp_path / "worse.json")], capsys)
    assert code == 1, out + err
    assert f"hftrain: gate failed: {TASK} exact_match,none improved by -" in err
    assert "less than --min-delta 0.0" in err


def test_a_run_folder_gives_its_base_its_rows_and_its_card_the_table(two_models, tmp_path, capsys):
    base, other_model = two_models
    run = tmp_path / "run"
    shutil.copytree(other_model, run)
    path = rows_file(tmp_path / "held_out.jsonl", answers(other_model))
    recipe = {"model": {"name_or_path": base}, "data": {"eval_sources": [{"path": path}]},
              "eval": {"max_new_tokens": MAX_NEW_TOKENS}, "training": {"output_dir": str(run)}}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    code, out, err = evaluated([str(run), "--limit", "4"], capsys)
    assert code == 0, out + err
    assert f"hftrain: {TASK}: {ROWS} held-out rows from {path} (answers up to {MAX_NEW_TOKENS} tokens)" in out
    written = json.loads((run / "eval_harness.json").read_text())
    assert written["base"] == base and written["limit"] == 4
    assert written["comparisons"][0]["trained"] == 1.0
    card = str(build_card(str(run), sorted(os.listdir(run))))
    assert "## Benchmarks" in card and f"against the base `{base}`, the first 4 rows of each task" in card
    assert f"| {TASK} | exact_match,none | " in card and "| 1.0000 |" in card


def test_a_task_folder_of_the_users_own_is_evaluated(two_models, tmp_path, capsys):
    base, other_model = two_models
    rows = rows_file(tmp_path / "rows.jsonl", answers(other_model))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text(yaml.safe_dump({
        "task": "my_reversal", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": rows}},
        "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{messages[0].content}}",
        "doc_to_target": "{{messages[1].content}}",
        "generation_kwargs": {"until": [], "max_gen_toks": MAX_NEW_TOKENS, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}))
    code, out, err = evaluated([other_model, "--base", base, "--tasks", "my_reversal", "--include-path", str(tasks),
                                "--output", str(tmp_path / "mine.json")], capsys)
    assert code == 0, out + err
    [mine] = json.loads((tmp_path / "mine.json").read_text())["comparisons"]
    assert (mine["task"], mine["trained"]) == ("my_reversal", 1.0) and mine["base"] < 1.0


def test_a_lora_adapter_is_evaluated_on_its_base(two_models, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    base, _ = two_models
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    for name in os.listdir(base):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(base, name), adapter)
    tokenizer = AutoTokenizer.from_pretrained(base)
    own = [greedy_answer(model.eval(), tokenizer, {"messages": row["messages"][:1]}, MAX_NEW_TOKENS)
           for row in prompts()]
    assert own != answers(base), "the adapter must change the answers"
    rows = rows_file(tmp_path / "rows.jsonl", own)
    code, out, err = evaluated([str(adapter), "--base", base, "--rows", rows, "--max-new-tokens",
                                str(MAX_NEW_TOKENS), "--output", str(tmp_path / "lora.json")], capsys)
    assert code == 0, out + err
    [lora] = json.loads((tmp_path / "lora.json").read_text())["comparisons"]
    assert lora["trained"] == 1.0 and lora["base"] < 1.0
    # A QLoRA run's adapter is refused: its base was quantised in training.
    (adapter / "recipe.yaml").write_text(yaml.safe_dump({"model": {"name_or_path": base,
                                                                   "quantization": {"bits": 4}}}))
    said = refused([str(adapter), "--rows", rows], capsys)
    assert "a QLoRA run's adapter" in said and f"hftrain eval {adapter / 'merged'} --base BASE" in said


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(["eval", *argv])
    assert stop.value.code == 2
    out = capsys.readouterr()
    return out.out + out.err


def test_rows_the_held_out_task_cannot_read_and_missing_models_are_named(tiny_model_dir, tmp_path, capsys):
    rows = tmp_path / "turns.jsonl"
    one = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    two = {"messages": one["messages"] * 2}
    rows.write_text(json.dumps(one) + "\n" + json.dumps(two) + "\n")
    said = refused([tiny_model_dir, "--rows", str(rows), "--no-base"], capsys)
    assert f"hftrain: error: {rows}:2: not one user message then the assistant's answer" in said
    said = refused([tiny_model_dir, "--rows", str(rows), "--base", "no/such-model"], capsys)
    assert "the base model 'no/such-model' is not a local folder here" in said and "--base FOLDER" in said
    said = refused([str(tmp_path), "--rows", str(rows), "--no-base"], capsys)
    assert f"{tmp_path}: not a model folder (no config.json or adapter_config.json)" in said
    said = refused([tiny_model_dir, "--no-base"], capsys)
    assert f"the task {TASK} needs held-out rows" in said and "--rows FILE" in said


def test_check_says_what_eval_harness_cannot_run(tiny_model_dir, tmp_path):
    from hftrain.errors import RecipeError
    from hftrain.launch import check_recipe

    from .test_bad_input import W

    w = W(str(tmp_path), tiny_model_dir)
    turns = tmp_path / "turns.jsonl"
    turns.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant",
                                                                             "content": "b"}] * 2}) + "\n")

    def problems(edit) -> list[str]:
        try:
            check_recipe(w.recipe(edit))
        except RecipeError as e:
            return e.problems
        return []

    def harness(rows=None, **section):
        def edit(tree):
            tree["eval"] = {"harness": section}
            if rows:
                tree["data"]["eval_sources"] = [{"path": rows}]
        return edit

    assert problems(harness()) == [f"{tmp_path / 'recipe.yaml'}: eval.harness.tasks: {TASK} is the run's held-out "
                                   "rows: set data.eval_sources, or name other tasks"]
    [bad_rows] = problems(harness(str(turns)))
    assert f"eval.harness.tasks: {turns}:1: not one user message then the assistant's answer" in bad_rows
    assert problems(harness(tasks=["mine"], include_path=str(tmp_path))) == []


@pytest.mark.launches
def test_a_run_benchmarks_its_saved_model_and_a_missed_gate_fails_it(tiny_model_dir, tmp_path):
    from .conftest import PY, run
    from .support import free_port

    out = tmp_path / "out"
    rows = tmp_path / "held_out.jsonl"
    rows.write_text("".join(open(DEMO_EVAL, encoding="utf-8").readlines()[:8]))
    tree = {"model": {"name_or_path": tiny_model_dir, "dtype": "float32"},
            "data": {"sources": [{"path": DEMO_EVAL}], "eval_sources": [{"path": str(rows)}], "max_length": 48},
            "eval": {"max_new_tokens": MAX_NEW_TOKENS, "harness": {"min_delta": 0.5}},
            "strategy": {"name": "ddp", "num_processes": 2, "main_process_port": free_port()},
            "training": {"output_dir": str(out), "max_steps": 2, "per_device_train_batch_size": 2,
                         "save_strategy": "no", "report_to": "none", "disable_tqdm": True}}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tree))
    r = run([PY, "-m", "hftrain.cli", "launch", str(recipe)], timeout=600)
    said = r.stdout + r.stderr
    assert r.returncode != 0, said[-3000:]
    assert "hftrain: eval.harness: the saved model in" in said and "in this process (the main one" in said
    assert f"gate failed: {TASK} exact_match,none improved by +0.0000 (base 0.0000 -> trained 0.0000), less than " \
           "eval.harness.min_delta 0.5" in said, said[-3000:]
    written = json.loads((out / "eval_harness.json").read_text())
    assert written["base"] == tiny_model_dir and written["comparisons"][0]["task"] == TASK
    assert (out / "model.safetensors").is_file()  # the saved model stays
