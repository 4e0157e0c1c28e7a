"""Process reward models (hftrain reward, reward: {kind: process}; methods/reward/process.py, step_rows.py): the
section's options, the rows' checks (all bad rows at once, by file and row), the step separator's token (split or
merged separators refused), labels at each step's end only, long rows left out, check and run refusing alike, the
loss as the exact mean over the labelled steps of the global batch (with its negative control) under ddp, fsdp and
zero3, held-out step accuracy / F1 over every rank equal to a hand computation, LoRA with the head saved, the card."""

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForTokenClassification, AutoTokenizer

from hftrain.data.split import split_rows
from hftrain.errors import DataError
from hftrain.methods import parse_recipe
from hftrain.methods.reward.step_scores import score_steps

from tests.exactness import beyond, within

from .support import assert_resume_exact, resume_variants
from .conftest import PY, launch_prefix, run, run_matrix


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def recipe_of(tmp_path, model_dir, rows, reward=None, **data):
    recipe, found = parse_recipe(None, [], raw={
        "model": {"name_or_path": model_dir}, "reward": {"kind": "process", **(reward or {})},
        "data": {"sources": [{"path": rows}], "max_length": 64, **data},
        "training": {"output_dir": str(tmp_path / "o")}})
    assert found == []
    return recipe


def read(tmp_path, model_dir, rows, reward=None, **data):
    from hftrain.launch import check_data

    return check_data(recipe_of(tmp_path, model_dir, rows, reward, **data), 1)


GOOD = {"prompt": "add 2 3:", "completions": ["2+3=5", "so 5"], "labels": [True, False]}


# -- the section --------------------------------------------------------------------------------------------------
def test_the_process_options_are_checked_and_belong_to_their_kind():
    def problems(*overrides):
        raw = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}, "reward": {}}
        return parse_recipe(None, list(overrides), raw=raw)[1]

    assert problems("reward.kind=process") == []
    found = problems("reward.step_separator=x", "reward.train_on_last_step_only=true")
    assert any("reward.step_separator: applies to kind process, not outcome" in p for p in found), found
    assert any("reward.train_on_last_step_only: applies to kind process, not outcome" in p for p in found), found
    found = problems("reward.kind=process", "reward.margin=m", "reward.step_separator=")
    assert any("reward.margin: applies to kind outcome, not process" in p for p in found), found
    assert any("reward.step_separator: must be non-empty text" in p for p in found), found
    found = problems("reward.kind=process", "data.sources.0.format=messages")
    assert any("data.sources.0.format: step rows are read by their columns prompt/completions/labels" in p
               for p in found), found


# -- rows ---------------------------------------------------------------------------------------------------------
def test_every_bad_row_is_named_at_once_by_file_row_and_key(tmp_path, tiny_model_dir):
    rows = write_rows(tmp_path / "bad.jsonl", [
        GOOD, {"prompt": "p", "completions": ["a", "b"]}, {"prompt": "p", "completions": ["a", "b"], "labels": [True]},
        {"prompt": "p", "completions": ["a"], "labels": [1]}, {"prompt": "p", "completions": ["a", " "],
                                                               "labels": [True, True]},
        {"prompt": "p", "completions": ["a\nb"], "labels": [True]}])
    with pytest.raises(DataError) as e:
        read(tmp_path, tiny_model_dir, rows)
    said = str(e.value)
    for line in (f"data.sources.0: {rows}:2: no 'labels' column", f"data.sources.0: {rows}:3: 2 steps but 1 labels",
                 f"data.sources.0: {rows}:4: labels[0]: must be true or false", f"{rows}:5: completions[1]: a step "
                 "must be non-empty text", f"{rows}:6: completions[0]: holds the step separator '\\n'"):
        assert line in said, said
    assert f"{rows}:1:" not in said


@pytest.mark.parametrize("separator, said", [
    ("\n\n", "reward.step_separator: '\\n\\n' tokenises to 2 tokens ['Ċ', 'Ċ']"),
    ("ab c", "reward.step_separator: 'ab c' tokenises to 3 tokens")])
def test_a_separator_without_a_token_of_its_own_is_refused_naming_its_tokens(tmp_path, tiny_model_dir, separator,
                                                                             said):
    rows = write_rows(tmp_path / "r.jsonl", [{"prompt": "p:", "completions": ["a", "b"], "labels": [True, True]}])
    with pytest.raises(DataError) as e:
        read(tmp_path, tiny_model_dir, rows, reward={"step_separator": separator})
    assert said in str(e.value), str(e.value)


def test_each_step_s_label_sits_on_its_separator_token_only(tmp_path, tiny_model_dir):
    """Text and conversation prompts: the label of step i on the i-th separator token of the joined text, -100
    elsewhere; the prompt rendered with the chat template; train_on_last_step_only keeps every held-out label."""
    from hftrain.methods.reward.step_rows import show_steps

    user = [{"role": "user", "content": "add 2 3"}]
    conv = write_rows(tmp_path / "conv.jsonl", [{**GOOD, "prompt": user}] * 4)
    tok, data = read(tmp_path, tiny_model_dir, conv)
    ids, labels = data.train[0]["input_ids"], data.train[0]["labels"]
    text = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True) + "2+3=5\nso 5\n"
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    newline = tok.convert_tokens_to_ids("Ċ")
    steps = [i for i, t in enumerate(ids) if t == newline][-2:]
    assert [(i, labels[i]) for i in range(len(ids)) if labels[i] != -100] == [(steps[0], 1), (steps[1], 0)]
    text_rows = write_rows(tmp_path / "text.jsonl", [GOOD] * 10)
    recipe = recipe_of(tmp_path, tiny_model_dir, text_rows, {"train_on_last_step_only": True}, eval_fraction=0.2)
    from hftrain.launch import check_data

    tok, data = check_data(recipe, 1)
    assert all(sorted(set(row)) == [-100, 0] for row in data.train["labels"])  # the last step's label only
    assert all(sorted(set(row)) == [-100, 0, 1] for row in data.eval["labels"])  # every step held out
    shown = json.loads(show_steps(recipe, tok, 1))
    assert shown["prompt"] == "add 2 3:" and [s["label"] for s in shown["steps"]] == [True, False]
    assert [s["step"] for s in shown["steps"]] == ["2+3=5\n", "so 5\n"]
    assert shown["prompt_tokens"] + sum(s["tokens"] for s in shown["steps"]) == shown["tokens"]


def test_rows_over_max_length_are_left_out_and_counted_and_none_left_is_refused(tmp_path, tiny_model_dir, capsys):
    long = {"prompt": "p:", "completions": ["a b c d e f g h i j"] * 4, "labels": [True] * 4}
    rows = write_rows(tmp_path / "r.jsonl", [GOOD, long, GOOD, GOOD])
    tok, data = read(tmp_path, tiny_model_dir, rows, max_length=30)
    assert len(data.train) == 3
    assert f"1 of 4 step rows of {rows} are left out: longer than data.max_length=30 tokens ({rows}:2)" in \
        capsys.readouterr().err
    with pytest.raises(DataError, match="every one of the 4 step rows .* raise data.max_length to"):
        read(tmp_path, tiny_model_dir, rows, max_length=5)


@pytest.mark.launches
def test_check_and_run_refuse_a_split_separator_and_a_bad_row_together(tmp_path, tiny_model_dir):
    rows = write_rows(tmp_path / "rows.jsonl", [GOOD, {"prompt": "p", "completions": ["a"], "labels": ["yes"]}])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({"model": {"name_or_path": tiny_model_dir}, "data": {"sources": [{"path": rows}]},
                                  "reward": {"kind": "process", "step_separator": "\n\n"},
                                  "training": {"output_dir": str(tmp_path / "out")}}))
    for cmd in ([PY, "-m", "hftrain.cli", "check", str(recipe)], [PY, "recipes/reward.py", str(recipe)]):
        r = run(cmd, timeout=240)
        said = r.stdout + r.stderr
        assert r.returncode == 2 and "Traceback" not in said, said[-3000:]
        assert "reward.step_separator: '\\n\\n' tokenises to 2 tokens" in said, said[-3000:]
        assert f"data.sources.0: {rows}:2: labels[0]: must be true or false" in said, said[-3000:]


def test_a_lora_token_classifier_trains_and_saves_its_head(tiny_model_dir):
    """peft's TOKEN_CLS task type (Head.peft_task_type) keeps the classification head trainable and saved whole."""
    from types import SimpleNamespace

    from hftrain.config import LoraSection, ModelSection
    from hftrain.methods.reward.process import METHOD

    section = ModelSection(name_or_path=tiny_model_dir, dtype="float32", lora=LoraSection(r=4, alpha=8))
    model = METHOD.model(SimpleNamespace(recipe=SimpleNamespace(model=section)))
    assert type(model).__name__ == "PeftModelForTokenClassification"
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert any(".score." in name and "modules_to_save" in name for name in trained), trained
    assert model.config.num_labels == 2 and model.config.id2label[1] == "correct_step"


# -- launches: exact over ranks and accumulation, held-out metrics, LoRA, the card --------------------------------
def uneven_steps(path, n, seed=0):
    """Rows of 1, 2 or 5 steps of 1 to 9 letters: very uneven labelled-step counts and lengths in every batch."""
    rng = random.Random(seed)

    def step():
        return " ".join(rng.choice("abcdefghij") for _ in range(rng.choice([1, 4, 9])))
    rows = []
    for _ in range(n):
        steps = [step() for _ in range(rng.choice([1, 2, 5]))]
        labels = [rng.random() < 0.5 for _ in steps]
        rows.append({"prompt": f"check: {step()}\n", "completions": steps, "labels": labels})
    return write_rows(path, rows)


def learnable_steps(path, n, seed=1):
    """Steps of three letters, correct when the last letter is one of a-e: a token classifier learns it quickly."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        steps = [" ".join(rng.choice("abcdefghij") for _ in range(3)) for _ in range(3)]
        rows.append({"prompt": "judge:\n", "completions": steps, "labels": [s[-1] in "abcde" for s in steps]})
    return write_rows(path, rows)


def plan(tmp, name, model_dir, rows, bs, ga, steps, module="hftrain.recipes.reward", reward=None, **extra):
    """One variant of a matrix launch on its own recipe, in tmp/name; plain SGD in fp32, so that the weights follow
    the losses' gradients exactly."""
    training = {"output_dir": str(tmp / name), "max_steps": steps, "per_device_train_batch_size": bs,
                "gradient_accumulation_steps": ga, "optim": "sgd", "learning_rate": 0.1,
                "per_device_eval_batch_size": 2,
                "lr_scheduler_type": "constant", "max_grad_norm": 0.0, "weight_decay": 0.0, "save_strategy": "no",
                "train_sampling_strategy": "sequential", "logging_steps": 1, "seed": 0, "report_to": "none",
                **extra.pop("training", {})}
    recipe = {"model": {"name_or_path": model_dir, "dtype": "float32", **extra.pop("model", {})},
              "data": {"sources": [{"path": str(rows)}], "max_length": 96, **extra.pop("data", {})},
              "reward": {"kind": "process", **(reward or {})}, "training": training, **extra}
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(recipe))
    return module, [str(path)]


def outcome(variant, out, world, strategy="ddp"):
    """(losses, final weights, metrics) of a variant's run, after checking it ran where it should."""
    variant.check()
    info = json.load(open(out / "run_info.json"))
    assert info["world_size"] == world and info["strategy"] == strategy
    history = json.load(open(out / "trainer_state.json"))["log_history"]
    return [h["loss"] for h in history if "loss" in h], load_file(str(out / "model.safetensors")), info


def by_hand(folder, recipe_path):
    """Held-out (mean CE over the labelled steps, step accuracy, F1 of the correct class, steps) of a saved model,
    one row at a time, on the held-out rows the recipe reads."""
    from hftrain.launch import check_data
    from hftrain.methods import parse_recipe as parse

    recipe, found = parse(str(recipe_path), [])
    assert found == []
    _, data = check_data(recipe, 1)
    model = AutoModelForTokenClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    loss, right, tp, fp, fn, steps = 0.0, 0, 0, 0, 0, 0
    with torch.no_grad():
        for row in data.eval:
            labels = torch.tensor(row["labels"])
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0]
            m = labels != -100
            loss += float(torch.nn.functional.cross_entropy(logits[m].double(), labels[m], reduction="sum"))
            predicted, truth = logits[m].argmax(-1), labels[m]
            right += int((predicted == truth).sum())
            tp += int(((predicted == 1) & (truth == 1)).sum())
            fp += int(((predicted == 1) & (truth == 0)).sum())
            fn += int(((predicted == 0) & (truth == 1)).sum())
            steps += int(m.sum())
    return loss / steps, right / steps, 2 * tp / (2 * tp + fp + fn), steps


def assert_metrics_by_hand(info, folder, recipe_path):
    loss, accuracy, f1, steps = by_hand(folder, recipe_path)
    metrics = info.get("metrics", info)
    within("process_reward.eval_vs_by_hand.loss", metrics["final_eval_loss"], loss, label=str(folder))
    assert metrics["final_eval_step_accuracy"] == pytest.approx(accuracy, rel=1e-6)
    assert metrics["final_eval_step_f1"] == pytest.approx(f1, rel=1e-6)
    assert metrics["final_eval_steps"] == steps  # every held-out row once, on whichever rank


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, spiky_model_dir, tiny_model_dir):
    """Every one-process run of this module in one launch (tests/matrix_worker.py)."""
    tmp = tmp_path_factory.mktemp("process_one_rank")
    six, sixteen = uneven_steps(tmp / "six.jsonl", 6), uneven_steps(tmp / "sixteen.jsonl", 16)
    held = uneven_steps(tmp / "held.jsonl", 5, seed=7)
    learn = learnable_steps(tmp / "learn.jsonl", 80)
    variants = {
        "bs6": plan(tmp, "bs6", spiky_model_dir, six, 6, 1, 1),
        "bs4_ga2": plan(tmp, "bs4_ga2", spiky_model_dir, six, 4, 2, 1),
        "bs4_ga2_mean_of_means": plan(tmp, "bs4_ga2_mean_of_means", spiky_model_dir, six, 4, 2, 1,
                                      module="tests.process_mean_of_means"),
        "1x_ga4": plan(tmp, "1x_ga4", spiky_model_dir, sixteen, 2, 4, 2, data={"eval_sources": [{"path": held}]}),
        "full": plan(tmp, "full", tiny_model_dir, learn, 8, 1, 40, data={"eval_fraction": 0.2},
                     training={"optim": "adamw_torch", "learning_rate": 0.01, "per_device_eval_batch_size": 5}),
        "lora": plan(tmp, "lora", tiny_model_dir, learn, 8, 1, 2, model={"lora": {"r": 4, "alpha": 8, "merge": True}}),
        **resume_variants(plan, tmp, spiky_model_dir, sixteen),
    }
    return tmp, run_matrix(launch_prefix(1), variants, tmp / "matrix", timeout=900), (sixteen, held)


@pytest.mark.launches
def test_unequal_micro_batches_give_the_global_step_mean_and_the_control_differs(one_rank):
    """6 rows in one step: micro-batches of 4 and 2 rows (GA2) train as one batch of 6. The per-micro-batch mean
    (the negative control) weighs the steps of the smaller micro-batch more."""
    tmp, variants, _ = one_rank
    one_loss, one_weights, _ = outcome(variants["bs6"], tmp / "bs6", 1)
    acc_loss, acc, _ = outcome(variants["bs4_ga2"], tmp / "bs4_ga2", 1)
    within("process_reward.accumulated_vs_one_batch.loss", acc_loss, one_loss)
    within("process_reward.accumulated_vs_one_batch.weights", acc, one_weights)
    control_loss, control, _ = outcome(variants["bs4_ga2_mean_of_means"], tmp / "bs4_ga2_mean_of_means", 1)
    beyond("process_reward.accumulated_vs_one_batch.loss", control_loss, one_loss)
    beyond("process_reward.accumulated_vs_one_batch.weights", control, one_weights)


@pytest.mark.launches
def test_held_out_step_accuracy_and_f1_before_and_after_equal_a_hand_count(one_rank):
    tmp, variants, _ = one_rank
    _, _, info = outcome(variants["full"], tmp / "full", 1)
    metrics = info.get("metrics", info)
    assert metrics["final_eval_step_accuracy"] > metrics["initial_eval_step_accuracy"] + 0.2, metrics
    assert "hftrain: eval_step_f1: before" in variants["full"].stdout
    assert_metrics_by_hand(info, tmp / "full", tmp / "full.yaml")


@pytest.mark.launches
def test_hftrain_score_gives_the_runs_own_held_out_figures(one_rank, tmp_path):
    """`hftrain score` (methods/reward/step_scores.py) of the trained process reward model on the rows its run held out
    (data.eval_fraction: the split remade by data/split.py's rule; the separator read from the run's recipe.yaml)
    gives the run's final eval_step_accuracy, eval_step_f1 and step count."""
    tmp, variants, _ = one_rank
    _, _, info = outcome(variants["full"], tmp / "full", 1)
    rows = (tmp / "learn.jsonl").read_text().splitlines()
    _, held = split_rows(len(rows), 0.2, 0, "data.sources.0", "learn.jsonl")  # the plan's training.seed: 0
    path = tmp_path / "held.jsonl"
    path.write_text("".join(rows[i] + "\n" for i in held))
    scores = score_steps(str(tmp / "full"), str(path), device="cpu")["all"]
    metrics = info.get("metrics", info)
    assert (scores.rows, scores.steps) == (len(held), metrics["final_eval_steps"])
    assert scores.step_accuracy == pytest.approx(metrics["final_eval_step_accuracy"], abs=1e-9)
    assert scores.step_f1 == pytest.approx(metrics["final_eval_step_f1"], abs=1e-9)


@pytest.mark.launches
def test_lora_trains_and_saves_the_token_head_and_its_merge_loads(one_rank):
    tmp, variants, _ = one_rank
    variants["lora"].check()
    out = tmp / "lora"
    adapter = load_file(str(out / "adapter_model.safetensors"))
    assert any("score" in k for k in adapter), list(adapter)  # modules_to_save: the head is saved whole
    merged = AutoModelForTokenClassification.from_pretrained(str(out / "merged"))
    assert merged.config.num_labels == 2 and merged.config.id2label[1] == "correct_step"


@pytest.mark.launches
def test_a_pushed_process_reward_model_names_its_auto_class_and_loads_with_it(one_rank, tmp_path, monkeypatch):
    from hftrain.config import HubSection
    from hftrain.hub.push import push

    tmp, variants, _ = one_rank
    variants["full"].check()
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    stage = push(str(tmp / "full"), HubSection(repo_id="me/prm"), dry_run=True)
    card = open(os.path.join(stage, "README.md")).read()
    assert "pipeline_tag: token-classification" in card and "AutoModelForTokenClassification" in card, card
    assert "process reward modelling" in card
    tok = AutoTokenizer.from_pretrained(stage)
    model = AutoModelForTokenClassification.from_pretrained(stage)
    assert model(**tok("judge:\na b c\n", return_tensors="pt")).logits.shape[-1] == 2


@pytest.mark.launches
@pytest.mark.parametrize("kind", ["whole", "lora"])
def test_a_resumed_process_reward_model_ends_where_the_uninterrupted_run_ends(one_rank, kind):
    tmp, variants, _ = one_rank
    assert_resume_exact(tmp, variants, kind, "process_reward")


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory, spiky_model_dir, one_rank):
    """2 ranks x GA2 (micro-batch 2, 8 rows a step) of the 16 uneven rows, one launch per strategy; 5 held-out rows
    (the last eval batch repeats a row on one rank)."""
    launches = {}

    def get(strategy):
        if strategy not in launches:
            if strategy.startswith("zero"):
                request.getfixturevalue("deepspeed_ops")
            tmp = tmp_path_factory.mktemp(f"process_two_ranks_{strategy}")
            sixteen, held = one_rank[2]
            variants = {"2x_ga2": plan(tmp, "2x_ga2", spiky_model_dir, sixteen, 2, 2, 2,
                                       data={"eval_sources": [{"path": held}]})}
            launches[strategy] = tmp, run_matrix(launch_prefix(2, strategy), variants, tmp / "matrix", ranks=2,
                                                 timeout=900)
        return launches[strategy]

    return get


@pytest.mark.launches
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_two_ranks_ga2_equal_one_rank_ga4(one_rank, two_ranks, strategy):
    """2 ranks x GA2 give 1 rank x GA4's losses and weights over two steps (fp32, rel 1e-5), and held-out metrics
    over both ranks' rows equal to a count by hand."""
    tmp1, variants1, _ = one_rank
    ref_loss, ref, ref_info = outcome(variants1["1x_ga4"], tmp1 / "1x_ga4", 1)
    tmp, variants = two_ranks(strategy)
    losses, final, info = outcome(variants["2x_ga2"], tmp / "2x_ga2", 2, strategy)
    within("process_reward.two_ranks_vs_one.losses", losses, ref_loss, label=strategy)
    within("process_reward.two_ranks_vs_one.weights", final, ref, label=strategy)
    assert_metrics_by_hand(info, tmp / "2x_ga2", tmp / "2x_ga2.yaml")
