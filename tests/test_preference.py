"""Preference tuning (recipes/dpo.py): the `preference:` section's rules, the pairs' row-named refusals, a short run
that saves a reloadable model, and the loss as the exact mean over the pairs of the global batch."""

import json
import os
import random

import pytest
import torch
import yaml
from safetensors.torch import load_file

from hftrain.config import parse_recipe
from hftrain.config.sections import DataSource
from hftrain.data.preference import read_pairs
from tests.support import free_port
from hftrain.errors import DataError
from hftrain.hub.card import build_card

from .conftest import ACCELERATE_LAUNCH, PY, REPO, assert_close_rel, run

PAIRS_TRAIN = os.path.join(REPO, "data", "demo", "preference_train.jsonl")
BASE = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}, "preference": {}}


def problems(*overrides, tree=None):
    return parse_recipe(None, list(overrides), raw=json.loads(json.dumps(tree or BASE)))[1]


# -- the preference: section ------------------------------------------------------------------------------------
def test_shipped_recipe_parses():
    recipe, found = parse_recipe(os.path.join(REPO, "recipes", "demo", "dpo.yaml"))
    assert found == [] and recipe.preference.loss_type == "sigmoid"


@pytest.mark.parametrize("override, expected", [
    ("preference.beta_=0.2", "command line: preference.beta_: unknown key; did you mean 'preference.beta'?"),
    ("preference.loss_type=cpo", "command line: preference.loss_type: expected one of 'sigmoid', 'ipo', 'simpo', "
                                 "'orpo', 'kto'"),
    ("preference.beta=0", "preference.beta: must be a finite number > 0, got 0.0"),
    ("preference.label_smoothing=0.5", "preference.label_smoothing: must be in [0, 0.5), got 0.5"),
    ("preference.simpo_gamma=1", "preference.simpo_gamma: applies to loss_type simpo, not 'sigmoid': remove it"),
    ("data.packing=true", "data.packing: applies to supervised fine-tuning, not to preference pairs"),
    ("eval.exact_match=5", "eval.exact_match: is not measured by preference tuning"),
    ("strategy.name=zero3_offload", "strategy.name: preference tuning runs under ddp, fsdp, zero2, zero3 (where"),
])
def test_config_errors_name_the_key_and_the_fix(override, expected):
    assert any(expected in p for p in problems(override)), problems(override)


def test_all_problems_at_once_and_loss_specific_rules():
    found = problems("preference.loss_type=ipo", "preference.label_smoothing=0.1", "preference.betaa=1",
                     "training.loss_averaging=sequence")
    assert len(found) == 3, found
    assert any("label_smoothing: does not apply to loss_type ipo" in p for p in found)
    found = problems("preference.loss_type=simpo", "preference.precompute_ref_log_probs=true")
    assert any("simpo is reference-free" in p for p in found), found
    assert problems("preference.loss_type=simpo", "preference.simpo_gamma=1.0") == []


def test_losses_map_to_trl():
    from hftrain.config import PreferenceSection
    from hftrain.preference import trl_loss

    assert trl_loss(PreferenceSection()) == "sigmoid"
    assert trl_loss(PreferenceSection(label_smoothing=0.1)) == "robust"  # TRL's sigmoid ignores label_smoothing
    assert trl_loss(PreferenceSection(loss_type="ipo")) == "ipo"
    assert trl_loss(PreferenceSection(loss_type="simpo")) == "sigmoid_norm"  # + the constant reference


def test_a_script_refuses_the_other_method(tmp_path, tiny_model_dir):
    tree = {"model": {"name_or_path": tiny_model_dir}, "data": {"sources": [{"path": PAIRS_TRAIN}]},
            "training": {"output_dir": str(tmp_path / "o")}}
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump(tree))
    r = run([PY, "recipes/dpo.py", str(rec)], timeout=120)
    assert (r.returncode == 2
            and "`hftrain dpo` (recipes/dpo.py) needs a preference: section" in r.stderr), r.stderr[-2000:]


# -- data: every bad row refused by file and line ----------------------------------------------------------------
def pair(prompt="reverse: a b", chosen="b a", rejected="a b"):
    return {"prompt": [{"role": "user", "content": prompt}], "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


@pytest.mark.parametrize("bad, message", [
    (pair(chosen="a b"), "chosen equals rejected: the pair states no preference"),
    (pair(rejected=" "), "rejected is empty"),
    ({"prompt": "x", "chosen": "y", "rejected": ""}, "rejected is empty"),
    ({"prompt": "x", "chosen": "y"}, "no 'rejected' column"),
    ({"prompt": "x", "chosen": [{"role": "assistant", "content": "y"}], "rejected": "z"}, "mixes text and message"),
    ({**pair(), "chosen": [{"role": "bot", "content": "b a"}]}, "unknown role 'bot'"),
    ({"prompt": "x", "chosen": "y", "rejected": "z"}, "is text but"),
])
def test_bad_rows_are_refused_naming_file_and_line(tmp_path, bad, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [pair(), pair(), bad]) + "\n")
    with pytest.raises(DataError) as e:
        read_pairs(DataSource(path=str(path)), "data.sources.0")
    assert f"data.sources.0: {path}:3: " in str(e.value) and message in str(e.value), str(e.value)


def test_whole_conversations_share_their_prompt_and_columns_are_renamed(tmp_path):
    def conv(answer):
        return [{"role": "user", "content": "reverse: a b"}, {"role": "assistant", "content": answer}]
    path = tmp_path / "conv.jsonl"
    path.write_text(json.dumps({"good": conv("b a"), "bad": conv("a b")}) + "\n")
    pairs, conversational = read_pairs(DataSource(path=str(path), columns={"chosen": "good", "rejected": "bad"}),
                                          "data.sources.0")
    assert conversational and pairs == [pair()]


def test_hftrain_check_refuses_a_bad_row_and_launch_picks_dpo_py(tmp_path, tiny_model_dir, capsys):
    from hftrain.cli import main as cli_main

    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps(pair()) + "\n" + json.dumps(pair(chosen="", rejected="x")) + "\n")
    tree = {"model": {"name_or_path": tiny_model_dir}, "data": {"sources": [{"path": str(data)}]}, "preference": {},
            "training": {"output_dir": str(tmp_path / "o"), "per_device_train_batch_size": 1}}
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump(tree))
    with pytest.raises(SystemExit) as e:
        cli_main(["check", str(rec)])
    assert e.value.code == 2
    assert f"data.sources.0: {data}:2: chosen is empty" in capsys.readouterr().err
    assert cli_main(["launch", "--dry-run", str(rec)]) == 0
    assert "-m hftrain.recipes.dpo" in capsys.readouterr().out


# -- runs -----------------------------------------------------------------------------------------------------
def write_recipe(tmp_path, name, model, data, **training):
    out = tmp_path / name
    tree = {"model": {"name_or_path": model, "dtype": "float32"},
            "data": {"sources": [{"path": str(data)}], "max_length": 64},
            "preference": training.pop("preference", {}),
            **({"compression": training.pop("compression")} if "compression" in training else {}),
            **({"hub": training.pop("hub")} if "hub" in training else {}),
            "training": {"output_dir": str(out), "seed": 0, "report_to": "none", "disable_tqdm": True,
                         "logging_steps": 1, **training}}
    if "eval" in training:
        tree["data"]["eval_sources"] = [{"path": str(training.pop("eval"))}]
        tree["training"].pop("eval")
    rec = tmp_path / f"{name}.yaml"
    rec.write_text(yaml.safe_dump(tree))
    return rec, out


def head(path, n, dest):
    with open(path) as fh:
        dest.write_text("".join(next(fh) for _ in range(n)))
    return dest


@pytest.mark.slow
def test_short_run_saves_a_model_that_reloads_and_resumes(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    data = head(PAIRS_TRAIN, 64, tmp_path / "train.jsonl")
    held = head(PAIRS_TRAIN.replace("train", "eval"), 32, tmp_path / "eval.jsonl")
    rec, out = write_recipe(tmp_path, "run", tiny_model_dir, data, eval=held, max_steps=4, save_steps=2,
                            per_device_train_batch_size=8, eval_strategy="steps", eval_steps=2, learning_rate=1e-3)
    r = run([PY, "recipes/dpo.py", str(rec)], timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "hftrain: eval_rewards/accuracies: before" in r.stdout
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.num_parameters() > 0
    for f in ("recipe.yaml", "run_info.json", "curves.png", "trainer_state.json", "checkpoint-4"):
        assert os.path.exists(out / f), f
    logged = [h for h in json.load(open(out / "trainer_state.json"))["log_history"] if "loss" in h]
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"} <= set(logged[0])
    card = str(build_card(str(out), os.listdir(out)))
    assert "trained by preference tuning (sigmoid loss, beta=0.1)" in card and tiny_model_dir in card
    # resume (as for SFT): from the newest complete checkpoint, two more steps
    r = run([PY, "recipes/dpo.py", str(rec), "training.resume_from_checkpoint=true", "training.max_steps=6"],
            timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert json.load(open(out / "trainer_state.json"))["global_step"] == 6


@pytest.mark.slow
def test_simpo_runs_without_a_reference_model(tmp_path, tiny_model_dir):
    data = head(PAIRS_TRAIN, 32, tmp_path / "train.jsonl")
    rec, out = write_recipe(tmp_path, "simpo", tiny_model_dir, data, max_steps=2, per_device_train_batch_size=8,
                            save_strategy="no", preference={"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 1.0})
    r = run([PY, "recipes/dpo.py", str(rec)], timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Computing reference log probs" not in r.stderr + r.stdout
    logged = [h for h in json.load(open(out / "trainer_state.json"))["log_history"] if "loss" in h]
    assert logged and all(h["loss"] > 0 for h in logged)


def uneven_pairs(path, n, seed=0):
    """Conversation pairs whose answers are 1 to 12 letters long: very uneven lengths within every batch."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        def word(k):
            return " ".join(rng.choice("abcdefghij") for _ in range(k))
        rows.append(pair(f"reverse: {word(3)}", word(rng.choice([1, 2, 8, 12])), word(rng.choice([1, 3, 12]))))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train(tmp_path, name, model, data, world, bs, ga, steps, preference=None, strategy="ddp", **extra):
    rec, out = write_recipe(tmp_path, name, model, data, **extra, max_steps=steps, per_device_train_batch_size=bs,
                            gradient_accumulation_steps=ga, optim="sgd", learning_rate=0.5,
                            lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, save_strategy="no",
                            train_sampling_strategy="sequential", preference=preference or {"beta": 0.5})
    cmd = [PY, "recipes/dpo.py", str(rec)] if world == 1 else [
        *ACCELERATE_LAUNCH, "--config_file", f"accelerate_configs/{strategy}.yaml", "--main_process_port",
        str(free_port()), "recipes/dpo.py", str(rec)]
    r = run(cmd, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    info = json.load(open(out / "run_info.json"))
    assert info["world_size"] == world and info["strategy"] == strategy
    assert world == 1 or info["wrapper"] == WRAPPERS[strategy], info["wrapper"]
    assert info.get("zero_stage") == {"zero2": 2, "zero3": 3}.get(strategy)
    history = json.load(open(out / "trainer_state.json"))["log_history"]
    if "compression" in extra:  # the section reaches the trainer: its metrics are logged each step
        assert all("comm/bytes_sent" in h for h in history if "loss" in h), history
    logged = [h["loss"] for h in history if "loss" in h]
    return logged, load_file(str(out / "model.safetensors"))


WRAPPERS = {"ddp": "DistributedDataParallel", "fsdp": "FSDPLlamaForCausalLM", "zero2": "DeepSpeedEngine",
            "zero3": "DeepSpeedEngine"}


@pytest.mark.slow
def test_unequal_micro_batches_give_the_global_pair_mean(tmp_path, spiky_model_dir):
    """6 pairs in one step: micro-batches of 4 and 2 (GA2) must train as one batch of 6. TRL alone returns each
    micro-batch's mean and the Trainer averages the two: the pairs of the short one would weigh double."""
    data = uneven_pairs(tmp_path / "six.jsonl", 6)
    one_loss, one = train(tmp_path, "bs6", spiky_model_dir, data, 1, 6, 1, 1, {"loss_type": "ipo", "beta": 0.5})
    acc_loss, acc = train(tmp_path, "bs4_ga2", spiky_model_dir, data, 1, 4, 2, 1, {"loss_type": "ipo", "beta": 0.5})
    assert acc_loss == pytest.approx(one_loss, rel=1e-5)
    assert_close_rel(acc, one)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, spiky_model_dir):
    """1 rank: one batch of 8 pairs, and micro-batches of 2 with GA4, over pairs of very uneven lengths."""
    tmp = tmp_path_factory.mktemp("one_rank")
    data = uneven_pairs(tmp / "pairs.jsonl", 16)
    return data, train(tmp, "1x_bs8", spiky_model_dir, data, 1, 8, 1, 2), train(tmp, "1x_ga4", spiky_model_dir,
                                                                               data, 1, 2, 4, 2)


@pytest.mark.slow
def test_one_rank_ga4_equals_one_batch(one_rank):
    _, (ref_loss, ref), (losses, final) = one_rank
    assert losses == pytest.approx(ref_loss, rel=1e-5)
    assert_close_rel(final, ref)


# The losses whose exactness across ranks is tested (sigmoid: DPO, whose runs above also hold the one-batch reference).
LOSSES = {"sigmoid": {"beta": 0.5}, "orpo": {"loss_type": "orpo", "beta": 0.5},
          "kto": {"loss_type": "kto", "beta": 0.5}}


def uneven_unpaired(path, n, seed=0, desirable=0.75):
    """KTO's rows (prompt, completion, label) with answers of 1 to 12 letters, about 3 in 4 desirable: the policy then
    raises the completions' log-probs under other prompts too, and the KL reference point leaves 0 from step 3."""
    rng = random.Random(seed)
    def word(k):
        return " ".join(rng.choice("abcdefghij") for _ in range(k))
    rows = [{"prompt": [{"role": "user", "content": f"reverse: {word(3)}"}], "label": rng.random() < desirable,
             "completion": [{"role": "assistant", "content": word(rng.choice([1, 2, 8, 12]))}]} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def one_rank_ga4(request, tmp_path_factory, spiky_model_dir):
    """1 rank x GA4 (micro-batches of 2) per loss, run once and shared by every strategy's 2-rank run: (data, steps,
    (losses, weights)). KTO: 3 steps of 8 of 32 unpaired examples, the last with its KL reference point above 0
    (asserted: a point clamped to 0 would hide how it was estimated)."""
    runs = {}

    def get(loss):
        if loss == "sigmoid":
            data, _, ga4 = request.getfixturevalue("one_rank")
            return data, 2, ga4
        if loss not in runs:
            tmp = tmp_path_factory.mktemp(f"one_rank_{loss}")
            data = uneven_unpaired(tmp / "kto.jsonl", 32) if loss == "kto" else uneven_pairs(tmp / "pairs.jsonl", 16)
            steps = 3 if loss == "kto" else 2
            runs[loss] = data, steps, train(tmp, f"1x_ga4_{loss}", spiky_model_dir, data, 1, 2, 4, steps, LOSSES[loss])
            if loss == "kto":
                history = json.load(open(tmp / f"1x_ga4_{loss}" / "trainer_state.json"))["log_history"]
                assert [h["kl"] for h in history if "loss" in h][-1] > 0.01, history
        return runs[loss]

    return get


@pytest.mark.slow
def test_orpo_one_batch_equals_its_micro_batches(tmp_path, spiky_model_dir, one_rank_ga4):
    """ORPO's NLL is a token mean: one batch of 8 pairs trains like 4 micro-batches of 2 (GA4) only with the chosen
    tokens counted over the whole step. (2 ranks x GA2 against 1 x GA4 cannot tell: with as many pairs in every
    micro-batch, TRL's mean of micro-batch means is the same in both; here its losses are off by 0.8%.)"""
    data, steps, (ref_loss, ref) = one_rank_ga4("orpo")
    losses, final = train(tmp_path, "1x_bs8_orpo", spiky_model_dir, data, 1, 8, 1, steps, LOSSES["orpo"])
    assert losses == pytest.approx(ref_loss, rel=1e-5)
    assert_close_rel(final, ref)


@pytest.mark.slow
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2", "zero3"])
def test_two_ranks_ga2_equal_one_rank_ga4(tmp_path, spiky_model_dir, one_rank_ga4, strategy, loss, request):
    """2 ranks x GA2 (micro-batch 2, global batch 8 pairs or KTO examples) give 1 rank x GA4's losses and weights over
    two steps (KTO three), for DPO, ORPO (its NLL a token mean: pairs of very uneven lengths) and KTO (its KL reference
    point over the step's 8 examples, not each micro-step's)."""
    if strategy.startswith("zero"):
        request.getfixturevalue("deepspeed_ops")
    data, steps, (ref_loss, ref) = one_rank_ga4(loss)
    # Under DDP the all-reduce runs through hftrain's timed hook (compression.profile): the same mean, exactly.
    extra = {"compression": {"profile": True}} if strategy == "ddp" else {}
    losses, final = train(tmp_path, f"2x_ga2_{strategy}_{loss}", spiky_model_dir, data, 2, 2, 2, steps, LOSSES[loss],
                          strategy=strategy, **extra)
    assert losses == pytest.approx(ref_loss, rel=1e-5)
    assert_close_rel(final, ref)


@pytest.mark.slow
def test_lora_run_saves_the_adapter(tmp_path, tiny_model_dir):
    """With LoRA TRL gets the base model and the LoraConfig: the reference is the base (adapter disabled), no copy."""
    data = head(PAIRS_TRAIN, 32, tmp_path / "train.jsonl")
    rec, out = write_recipe(tmp_path, "lora", tiny_model_dir, data, max_steps=2, per_device_train_batch_size=8,
                            save_strategy="no")
    r = run([PY, "recipes/dpo.py", str(rec), "model.lora.r=4"], timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert os.path.exists(out / "adapter_model.safetensors")
    assert list(json.load(open(out / "adapter_config.json"))["target_modules"])


def test_simpo_loss_is_simpos_formula(tmp_path, tiny_model_dir):
    """TRL's sigmoid_norm with the constant reference PreferenceTrainer sets is SimPO's loss:
    mean over pairs of -logsigmoid(beta * (mean logp chosen - mean logp rejected) - gamma)."""
    from transformers import AutoModelForCausalLM

    from hftrain.launch import check_data
    from hftrain.launch.setup import run_arguments
    from hftrain.preference import PreferenceTrainer, dpo_config

    beta, gamma = 2.0, 0.7
    data = uneven_pairs(tmp_path / "pairs.jsonl", 4)
    recipe, found = parse_recipe(None, [], raw={
        "model": {"name_or_path": tiny_model_dir, "dtype": "float32"},
        "data": {"sources": [{"path": str(data)}], "max_length": 64},
        "preference": {"loss_type": "simpo", "beta": beta, "simpo_gamma": gamma},
        "training": {"output_dir": str(tmp_path / "o"), "report_to": "none", "per_device_train_batch_size": 4}})
    assert found == []
    tokenizer, pairs = check_data(recipe, 1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = PreferenceTrainer(model=model, args=dpo_config(recipe, **run_arguments(recipe)),
                                train_dataset=pairs.train, processing_class=tokenizer)
    rows = [trainer.train_dataset[i] for i in range(4)]
    trainer.model.eval()
    with torch.no_grad():
        got = trainer.compute_loss(trainer.model, trainer._prepare_inputs(trainer.data_collator(rows)))
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def mean_logp(prompt, answer):
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logp = plain(input_ids=ids).logits[0, :-1].log_softmax(-1)
        return logp[torch.arange(len(prompt) - 1, ids.shape[1] - 1), ids[0, len(prompt):]].mean()

    want = torch.stack([-torch.nn.functional.logsigmoid(
        beta * (mean_logp(r["prompt_ids"], r["chosen_ids"]) - mean_logp(r["prompt_ids"], r["rejected_ids"])) - gamma)
        for r in rows]).mean()
    assert float(got) == pytest.approx(float(want), rel=1e-5)


@pytest.mark.slow
def test_precomputed_reference_trains_like_the_frozen_copy(tmp_path, spiky_model_dir):
    data = uneven_pairs(tmp_path / "pairs.jsonl", 8)
    copy_loss, copy = train(tmp_path, "copy", spiky_model_dir, data, 1, 4, 1, 2)
    pre_loss, pre = train(tmp_path, "pre", spiky_model_dir, data, 1, 4, 1, 2,
                          {"beta": 0.5, "precompute_ref_log_probs": True})
    assert pre_loss == pytest.approx(copy_loss, rel=1e-5)
    assert_close_rel(pre, copy)
