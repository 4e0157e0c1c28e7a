"""Preference tuning (recipes/dpo.py): the `preference:` section's rules, the pairs' row-named refusals, a short run
that saves a reloadable model, and the loss as the exact mean over the pairs of the global batch."""

import json
import re
import os
import random

import pytest
import torch
import yaml
from safetensors.torch import load_file

from hftrain.methods import parse_recipe
from hftrain.config.sections import DataSource
from hftrain.methods.pairs import read_pairs
from hftrain.errors import DataError
from hftrain.hub.card import build_card

from tests.exactness import within

from .conftest import PY, REPO, launch_prefix, run, run_matrix

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
    from hftrain.methods import PreferenceSection
    from hftrain.methods.preference.dpo import trl_loss

    assert trl_loss(PreferenceSection()) == "sigmoid"
    assert trl_loss(PreferenceSection(label_smoothing=0.1)) == "robust"  # TRL's sigmoid ignores label_smoothing
    assert trl_loss(PreferenceSection(loss_type="ipo")) == "ipo"
    from hftrain.methods import load_recipe
    from hftrain.methods import method_of
    from hftrain.methods.preference.simpo import TRL_LOSS, SimPOTrainer

    assert TRL_LOSS == "sigmoid_norm"  # + the constant reference
    simpo = method_of(load_recipe(os.path.join(REPO, "recipes", "demo", "dpo.yaml"), ["preference.loss_type=simpo"]))
    assert simpo.name == "simpo" and simpo.trainer_class is SimPOTrainer


def test_a_script_refuses_the_other_method(tmp_path, tiny_model_dir, capsys, in_process):
    """recipes/dpo.py's main(argv), in this process: the message and the exit status are what is tested."""
    from hftrain.recipes.dpo import main

    tree = {"model": {"name_or_path": tiny_model_dir}, "data": {"sources": [{"path": PAIRS_TRAIN}]},
            "training": {"output_dir": str(tmp_path / "o")}}
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump(tree))
    with pytest.raises(SystemExit) as e:
        main([str(rec)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "`hftrain dpo` (recipes/dpo.py) needs a preference: section" in err, err[-2000:]


# -- data: every bad row refused by file and line ----------------------------------------------------------------
def pair(prompt="reverse: a b", chosen="b a", rejected="a b"):
    return {"prompt": [{"role": "user", "content": prompt}], "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


@pytest.mark.parametrize("bad, message", [
    (pair(chosen="a b"), "chosen equals rejected: the pair states no preference"),
    (pair(rejected=" "), "rejected is empty"),
    ({"prompt": "x", "chosen": "y", "rejected": ""}, "rejected is empty"),
    ({"prompt": "x", "chosen": "y"}, "no 'rejected' column"),
    ({"prompt": "x", "chosen": "y", "rejected": None}, "'rejected' is null: a pair needs an answer on both sides"),
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


@pytest.mark.launches
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


def plan(tmp_path, name, model, data, bs, ga, steps, preference=None, **extra) -> tuple[str, list[str]]:
    """One variant of a matrix launch (tests/matrix_worker.py): recipes/dpo.py on its own recipe, in tmp_path/name."""
    rec, _ = write_recipe(tmp_path, name, model, data, **extra, max_steps=steps, per_device_train_batch_size=bs,
                          gradient_accumulation_steps=ga, optim="sgd", learning_rate=0.5,
                          lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, save_strategy="no",
                          train_sampling_strategy="sequential", preference=preference or {"beta": 0.5})
    return "hftrain.recipes.dpo", [str(rec)]


def outcome(variant, out, world, strategy="ddp", compression=False):
    """(losses, final weights) of a variant's run, after checking it ran where it should."""
    variant.check()
    info = json.load(open(out / "run_info.json"))
    assert info["world_size"] == world and info["strategy"] == strategy
    assert world == 1 or info["wrapper"] == WRAPPERS[strategy], info["wrapper"]
    assert info.get("zero_stage") == {"zero2": 2, "zero3": 3}.get(strategy)
    history = json.load(open(out / "trainer_state.json"))["log_history"]
    if compression:  # the section reaches the trainer: its metrics are logged each step
        assert all("comm/bytes_sent" in h for h in history if "loss" in h), history
    logged = [h["loss"] for h in history if "loss" in h]
    return logged, load_file(str(out / "model.safetensors"))


WRAPPERS = {"ddp": "DistributedDataParallel", "fsdp": "FSDPLlamaForCausalLM", "zero2": "DeepSpeedEngine",
            "zero3": "DeepSpeedEngine"}


# The losses whose exactness across ranks is tested (sigmoid: DPO, whose runs above also hold the one-batch reference).
LOSSES = {"sigmoid": {"beta": 0.5}, "orpo": {"loss_type": "orpo", "beta": 0.5},
          "kto": {"loss_type": "kto", "beta": 0.5}}
STEPS = {"sigmoid": 2, "orpo": 2, "kto": 3}  # KTO: 3 steps of 8 of 32 examples, the last with its KL point above 0
IPO = {"loss_type": "ipo", "beta": 0.5}


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
def one_rank(tmp_path_factory, spiky_model_dir, tiny_model_dir):
    """Every one-process run of this module, in one launch (tests/matrix_worker.py): (folder, {name: variant}) and
    the data per loss. Pairs of very uneven lengths; KTO's 32 unpaired examples."""
    tmp = tmp_path_factory.mktemp("one_rank")
    data = {"sigmoid": uneven_pairs(tmp / "pairs.jsonl", 16), "kto": uneven_unpaired(tmp / "kto.jsonl", 32)}
    data["orpo"] = data["sigmoid"]
    six, eight = uneven_pairs(tmp / "six.jsonl", 6), uneven_pairs(tmp / "eight.jsonl", 8)
    demo = head(PAIRS_TRAIN, 32, tmp / "demo.jsonl")
    spiky = spiky_model_dir
    variants = {
        "bs6": plan(tmp, "bs6", spiky, six, 6, 1, 1, IPO), "bs4_ga2": plan(tmp, "bs4_ga2", spiky, six, 4, 2, 1, IPO),
        "1x_bs8": plan(tmp, "1x_bs8", spiky, data["sigmoid"], 8, 1, 2),
        "1x_bs8_orpo": plan(tmp, "1x_bs8_orpo", spiky, data["orpo"], 8, 1, 2, LOSSES["orpo"]),
        **{f"1x_ga4_{loss}": plan(tmp, f"1x_ga4_{loss}", spiky, data[loss], 2, 4, STEPS[loss], LOSSES[loss])
           for loss in LOSSES},
        "copy": plan(tmp, "copy", spiky, eight, 4, 1, 2),
        "pre": plan(tmp, "pre", spiky, eight, 4, 1, 2, {"beta": 0.5, "precompute_ref_log_probs": True}),
    }
    rec, _ = write_recipe(tmp, "lora", tiny_model_dir, demo, max_steps=2, per_device_train_batch_size=8,
                          save_strategy="no")
    variants["lora"] = ("hftrain.recipes.dpo", [str(rec), "model.lora.r=4"])
    rec, _ = write_recipe(tmp, "simpo", tiny_model_dir, demo, max_steps=2, per_device_train_batch_size=8,
                          save_strategy="no", preference={"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 1.0})
    variants["simpo"] = ("hftrain.recipes.dpo", [str(rec)])
    return tmp, run_matrix(launch_prefix(1), variants, tmp / "matrix", timeout=900), data


def untied(a: dict, b: dict) -> tuple[dict, dict]:
    """Both weight dicts on the keys they share: savers differ only in whether they also write the tied
    lm_head.weight (equal to the embedding)."""
    assert {k for k in a if k != "lm_head.weight"} == {k for k in b if k != "lm_head.weight"}
    return {k: v for k, v in a.items() if k in b}, {k: v for k, v in b.items() if k in a}


def one(one_rank, name):
    tmp, variants, _ = one_rank
    return outcome(variants[name], tmp / name, 1)


@pytest.mark.launches
def test_unequal_micro_batches_give_the_global_pair_mean(one_rank):
    """6 pairs in one step: micro-batches of 4 and 2 (GA2) must train as one batch of 6. TRL alone returns each
    micro-batch's mean and the Trainer averages the two: the pairs of the short one would weigh double."""
    one_loss, one_weights = one(one_rank, "bs6")
    acc_loss, acc = one(one_rank, "bs4_ga2")
    within("preference.unequal_micro_batches_vs_one_batch.loss", acc_loss, one_loss)
    within("preference.unequal_micro_batches_vs_one_batch.weights", *untied(acc, one_weights))


@pytest.mark.launches
def test_one_rank_ga4_equals_one_batch(one_rank):
    ref_loss, ref = one(one_rank, "1x_bs8")
    losses, final = one(one_rank, "1x_ga4_sigmoid")
    within("preference.ga4_vs_one_batch.losses", losses, ref_loss, label="sigmoid")
    within("preference.ga4_vs_one_batch.weights", *untied(final, ref), label="sigmoid")


@pytest.mark.launches
def test_kto_reference_point_leaves_zero(one_rank):
    """KTO's last step has its KL reference point above 0: a point clamped to 0 would hide how it was estimated."""
    one(one_rank, "1x_ga4_kto")
    history = json.load(open(one_rank[0] / "1x_ga4_kto" / "trainer_state.json"))["log_history"]
    assert [h["kl"] for h in history if "loss" in h][-1] > 0.01, history


@pytest.mark.launches
def test_orpo_one_batch_equals_its_micro_batches(one_rank):
    """ORPO's NLL is a token mean: one batch of 8 pairs trains like 4 micro-batches of 2 (GA4) only with the chosen
    tokens counted over the whole step. (2 ranks x GA2 against 1 x GA4 cannot tell: with as many pairs in every
    micro-batch, TRL's mean of micro-batch means is the same in both; here its losses are off by 0.8%.)"""
    ref_loss, ref = one(one_rank, "1x_ga4_orpo")
    losses, final = one(one_rank, "1x_bs8_orpo")
    within("preference.ga4_vs_one_batch.losses", losses, ref_loss, label="orpo")
    within("preference.ga4_vs_one_batch.weights", *untied(final, ref), label="orpo")


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory, spiky_model_dir, one_rank):
    """2 ranks x GA2 (micro-batch 2) of every loss, one launch per strategy: strategy -> (folder, {loss: variant})."""
    launches = {}

    def get(strategy):
        if strategy not in launches:
            if strategy.startswith("zero"):
                request.getfixturevalue("deepspeed_ops")
            tmp = tmp_path_factory.mktemp(f"two_ranks_{strategy}")
            # Under DDP the all-reduce runs through hftrain's timed hook (compression.profile): the same mean, exactly.
            extra = {"compression": {"profile": True}} if strategy == "ddp" else {}
            variants = {loss: plan(tmp, loss, spiky_model_dir, one_rank[2][loss], 2, 2, STEPS[loss], LOSSES[loss],
                                   **extra) for loss in LOSSES}
            launches[strategy] = tmp, run_matrix(launch_prefix(2, strategy), variants, tmp / "matrix", ranks=2,
                                                 timeout=900)
        return launches[strategy]

    return get


@pytest.mark.launches
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2", "zero3"])
def test_two_ranks_ga2_equal_one_rank_ga4(one_rank, two_ranks, strategy, loss):
    """2 ranks x GA2 (micro-batch 2, global batch 8 pairs or KTO examples) give 1 rank x GA4's losses and weights over
    two steps (KTO three), for DPO, ORPO (its NLL a token mean: pairs of very uneven lengths) and KTO (its KL reference
    point over the step's 8 examples, not each micro-step's)."""
    ref_loss, ref = one(one_rank, f"1x_ga4_{loss}")
    tmp, variants = two_ranks(strategy)
    losses, final = outcome(variants[loss], tmp / loss, 2, strategy, compression=strategy == "ddp")
    if strategy == "fsdp" and loss in ("sigmoid", "kto"):  # TRL's reference copy, sharded per layer as the policy
        placed = re.search(r"the reference \(a frozen copy of model\): placed by fully_shard per layer .*rank 0 "
                           r"holds ([\d,]+) of its ([\d,]+) parameters, at most ([\d,]+) gathered at once",
                           variants[loss].stdout)
        assert placed, variants[loss].stdout[-2000:]
        held, total, unit = (int(n.replace(",", "")) for n in placed.groups())
        assert held < total and unit < total / 2, (held, total, unit)
    within("preference.two_ranks_vs_one.losses", losses, ref_loss, label=f"{strategy} {loss}")
    within("preference.two_ranks_vs_one.weights", *untied(final, ref), label=f"{strategy} {loss}")


@pytest.mark.launches
def test_lora_run_saves_the_adapter(one_rank):
    """With LoRA TRL gets the base model and the LoraConfig: the reference is the base (adapter disabled), no copy."""
    tmp, variants, _ = one_rank
    variants["lora"].check()
    out = tmp / "lora"
    assert os.path.exists(out / "adapter_model.safetensors")
    assert list(json.load(open(out / "adapter_config.json"))["target_modules"])


@pytest.mark.launches
def test_simpo_runs_without_a_reference_model(one_rank):
    tmp, variants, _ = one_rank
    variants["simpo"].check()
    assert "Computing reference log probs" not in variants["simpo"].stderr + variants["simpo"].stdout
    logged = [h for h in json.load(open(tmp / "simpo" / "trainer_state.json"))["log_history"] if "loss" in h]
    assert logged and all(h["loss"] > 0 for h in logged)


@pytest.mark.launches
def test_precomputed_reference_trains_like_the_frozen_copy(one_rank):
    copy_loss, copy = one(one_rank, "copy")
    pre_loss, pre = one(one_rank, "pre")
    within("preference.precomputed_vs_frozen_copy.losses", pre_loss, copy_loss)
    within("preference.precomputed_vs_frozen_copy.weights", *untied(pre, copy))
    # Negative control for the output split above: the precomputing run's own output says it computes them.
    assert "Computing reference log probs" in one_rank[1]["pre"].stderr + one_rank[1]["pre"].stdout


def test_simpo_loss_is_simpos_formula(tmp_path, tiny_model_dir):
    """TRL's sigmoid_norm with the constant reference SimPOTrainer sets is SimPO's loss:
    mean over pairs of -logsigmoid(beta * (mean logp chosen - mean logp rejected) - gamma)."""
    from transformers import AutoModelForCausalLM

    from hftrain.launch import check_data
    from hftrain.launch.setup import run_arguments
    from hftrain.methods.preference.simpo import SimPOTrainer, simpo_config

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
    trainer = SimPOTrainer(model=model, args=simpo_config(recipe, **run_arguments(recipe)),
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
    within("preference.simpo_vs_formula.loss", float(got), float(want))
