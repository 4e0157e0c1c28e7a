"""ORPO and KTO (preference.loss_type orpo / kto): their rules, KTO's unpaired rows refused by file and row, what
`hftrain data` shows, and each loss equal to its formula computed here from plain forwards, whole and split into
micro-batches with the global counts (the exactness across ranks is tests/test_preference.py's, multi-process)."""

import json
import os
import random

import pytest
import torch
import torch.nn.functional as F
import yaml

from hftrain.methods import parse_recipe
from hftrain.config.sections import DataSection, DataSource
from hftrain.methods.preference.unpaired import build_unpaired_data, read_unpaired, split_in_two
from hftrain.errors import DataError

from tests.exactness import beyond, within

from .conftest import REPO

PAIRS_TRAIN = os.path.join(REPO, "data", "demo", "preference_train.jsonl")
BASE = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}, "preference": {}}


def problems(*overrides):
    return parse_recipe(None, list(overrides), raw=json.loads(json.dumps(BASE)))[1]


# -- the preference: section ------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, expected", [
    (["preference.loss_type=sigmoid", "preference.desirable_weight=2"],
     "preference.desirable_weight: applies to loss_type kto, not 'sigmoid': remove it"),
    (["preference.loss_type=kto", "preference.undesirable_weight=0"],
     "preference.undesirable_weight: must be a finite number > 0, got 0"),
    (["preference.loss_type=kto", "training.per_device_train_batch_size=1"],
     "training.per_device_train_batch_size: kto needs at least 2 examples per micro-batch, got 1"),
    (["preference.loss_type=kto", "training.train_sampling_strategy=random"],
     "training.train_sampling_strategy: must be sequential for kto, got 'random'"),
    (["preference.loss_type=orpo", "preference.label_smoothing=0.1"],
     "preference.label_smoothing: does not apply to loss_type orpo"),
    (["preference.loss_type=orpo", "preference.precompute_ref_log_probs=true"],
     "preference.precompute_ref_log_probs: loss_type orpo is reference-free"),
    (["preference.loss_type=orpo", "training.include_num_input_tokens_seen=all"],
     "training.include_num_input_tokens_seen: cannot count ORPO's tokens"),
])
def test_config_errors_name_the_key_and_the_fix(overrides, expected):
    found = problems(*overrides)
    assert any(expected in p for p in found), found


@pytest.mark.parametrize("name, loss", [("kto", "kto"), ("orpo", "orpo")])
def test_shipped_demo_recipes_parse(name, loss):
    recipe, found = parse_recipe(os.path.join(REPO, "recipes", "demo", f"{name}.yaml"))
    assert found == [] and recipe.preference.loss_type == loss


def test_the_defaults_are_valid():
    assert problems("preference.loss_type=orpo") == []
    assert problems("preference.loss_type=kto", "preference.desirable_weight=1.33",
                    "preference.precompute_ref_log_probs=true") == []


@pytest.mark.parametrize("loss", ["sigmoid", "orpo", "kto"])
def test_trl_configs_run_in_the_recipes_precision(loss):
    """TRL's configs turn bf16 on when the recipe says nothing (hftrain's default, and TrainingArguments', is off)."""
    from hftrain.launch.setup import run_arguments
    from hftrain.methods import method_of

    for overrides, bf16 in (([], False), (["training.bf16=true"], True)):
        recipe, _ = parse_recipe(None, [f"preference.loss_type={loss}", *overrides], raw=json.loads(json.dumps(BASE)))
        assert method_of(recipe).name == {"sigmoid": "dpo"}.get(loss, loss)
        args = method_of(recipe).arguments(recipe, **run_arguments(recipe))
        assert (args.bf16, args.fp16) == (bf16, False)


# -- KTO's data: unpaired rows, or pairs split in two ------------------------------------------------------------
def unpaired(prompt="reverse: a b", completion="b a", label=True):
    return {"prompt": [{"role": "user", "content": prompt}],
            "completion": [{"role": "assistant", "content": completion}], "label": label}


def pair(prompt="reverse: a b", chosen="b a", rejected="a b"):
    return {"prompt": [{"role": "user", "content": prompt}], "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("bad, message", [
    ({k: v for k, v in unpaired().items() if k != "label"}, "no 'label' column (the row has ['prompt', 'completion'])"),
    (unpaired(label="yes"), ("label must be true or false (a JSON boolean: true for a desirable completion, false "
                             "for an undesirable one), got str 'yes'")),
    (unpaired(label=1), "label must be true or false"),
    (unpaired(completion=" "), "completion is empty"),
    ({"prompt": "x", "completion": [{"role": "assistant", "content": "y"}], "label": True}, "mixes text and message"),
    (pair(), "is a pair but"),
    ({"prompt": "x", "completion": "y", "label": False}, "is text but"),
])
def test_bad_rows_are_refused_naming_file_and_line(tmp_path, bad, message):
    path = write(tmp_path / "kto.jsonl", [unpaired(), unpaired(label=False), bad])
    with pytest.raises(DataError) as e:
        read_unpaired(DataSource(path=path), "data.sources.0")
    assert f"data.sources.0: {path}:3: " in str(e.value) and message in str(e.value), str(e.value)


def test_pairs_are_split_in_two_and_columns_renamed(tmp_path):
    ds, paired, conversational = read_unpaired(DataSource(path=write(tmp_path / "p.jsonl", [
        pair(), pair("reverse: c d", "d c", "c d")])), "data.sources.0")
    ds = split_in_two(ds, paired)
    assert paired and conversational and len(ds) == 4 and ds["label"] == [True, True, False, False]
    assert [c[0]["content"] for c in ds["completion"]] == ["b a", "d c", "a b", "c d"]
    rows = [{"q": "2+2=", "a": "4", "ok": True}, {"q": "2+2=", "a": "5", "ok": False}]
    ds, paired, conversational = read_unpaired(DataSource(path=write(tmp_path / "u.jsonl", rows),
                                                          columns={"prompt": "q", "completion": "a", "label": "ok"}),
                                               "k")
    assert not paired and not conversational and ds.to_list() == [
        {"prompt": "2+2=", "completion": "4", "label": True}, {"prompt": "2+2=", "completion": "5", "label": False}]


def test_held_out_pairs_stay_whole(tmp_path):
    """data.eval_fraction holds out pairs, then splits them: no prompt has an answer on each side."""
    pairs = write(tmp_path / "pairs.jsonl", [pair(f"reverse: {c} {d}", f"{d} {c}", f"{c} {d}")
                                             for c in "abcdefgh" for d in "xyz"])
    data = build_unpaired_data(DataSection(sources=[DataSource(path=pairs)], eval_fraction=0.25), True)
    prompts = [{r["prompt"][0]["content"] for r in part} for part in (data.train, data.eval)]
    assert (len(data.train), len(data.eval)) == (36, 12) and not prompts[0] & prompts[1]


def test_one_label_only_is_refused_by_key_and_the_examples_are_shuffled_once(tmp_path):
    good = write(tmp_path / "good.jsonl", [unpaired(f"reverse: {c} b", f"b {c}") for c in "acdefg"])
    with pytest.raises(DataError) as e:
        build_unpaired_data(DataSection(sources=[DataSource(path=good)]), True)
    assert str(e.value).startswith("data.sources: every example (6) is desirable (label true): KTO weighs desirable "
                                   "against undesirable examples and needs both"), str(e.value)
    pairs = write(tmp_path / "pairs.jsonl", [pair(f"reverse: {c} b", f"b {c}", f"{c} b") for c in "acdefghijk"])
    with pytest.raises(DataError) as e:
        build_unpaired_data(DataSection(sources=[DataSource(path=pairs)], eval_sources=[DataSource(path=good)]), True)
    assert str(e.value).startswith("data.eval_sources: every example (6) is desirable"), str(e.value)
    a = build_unpaired_data(DataSection(sources=[DataSource(path=pairs)]), True, seed=3).train
    b = build_unpaired_data(DataSection(sources=[DataSource(path=pairs)]), True, seed=3).train
    assert a.to_list() == b.to_list() and len(a) == 20
    # TRL's split puts every chosen answer first; shuffled, the labels alternate within the first micro-batches
    assert a["label"] != [True] * 10 + [False] * 10 and set(a["label"][:4]) == {True, False}


def recipe_file(tmp_path, model, data, preference, **training):
    tree = {"model": {"name_or_path": model, "dtype": "float32"},
            "data": {"sources": [{"path": str(data)}], "max_length": 64}, "preference": preference,
            "training": {"output_dir": str(tmp_path / "o"), "report_to": "none", "per_device_train_batch_size": 2,
                         **training}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def test_hftrain_data_shows_unpaired_examples_and_check_refuses_a_bad_label(tmp_path, tiny_model_dir, capsys):
    from hftrain.cli import main as cli_main

    rec = recipe_file(tmp_path, tiny_model_dir, PAIRS_TRAIN, {"loss_type": "kto"})
    assert cli_main(["data", rec, "--examples", "3"]) == 0
    out, err = capsys.readouterr()
    shown = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(shown) == 3 and all(set(r) == {"prompt", "completion", "label"} for r in shown), out
    assert "2000 examples (1000 desirable, 1000 undesirable)" in err and "in training order" in err
    bad = write(tmp_path / "bad.jsonl", [unpaired(), unpaired(label="false")])
    with pytest.raises(SystemExit) as e:
        cli_main(["check", recipe_file(tmp_path, tiny_model_dir, bad, {"loss_type": "kto"})])
    assert e.value.code == 2 and f"data.sources.0: {bad}:2: label must be true or false" in capsys.readouterr().err


# -- the losses, against their formulas ---------------------------------------------------------------------------
def uneven_pairs(path, n, seed=0):
    rng = random.Random(seed)
    def word(k):
        return " ".join(rng.choice("abcdefghij") for _ in range(k))
    return write(path, [pair(f"reverse: {word(3)}", word(rng.choice([1, 2, 8, 12])), word(rng.choice([1, 3, 12])))
                        for _ in range(n)])


def build_trainer(tmp_path, model_dir, preference, n_pairs=4, lora=None):
    """The trainer hftrain dpo builds for this preference section (the policy and LoRA config as the recipe's)."""
    from hftrain.launch import check_data
    from hftrain.launch.setup import run_arguments
    from hftrain.methods import method_of
    from hftrain.methods.policy import load_policy, policy_peft_config

    rec = recipe_file(tmp_path, model_dir, uneven_pairs(tmp_path / "pairs.jsonl", n_pairs), preference)
    recipe, found = parse_recipe(rec, [f"model.lora.r={lora}"] if lora else [])
    assert found == []
    tokenizer, data = check_data(recipe, 1)
    method = method_of(recipe)
    return method.trainer_class(model=load_policy(recipe.model), args=method.arguments(recipe, **run_arguments(recipe)),
                         train_dataset=data.train, processing_class=tokenizer,
                         peft_config=policy_peft_config(recipe.model))


def plain_model(trainer):
    """A plain copy of the trainer's policy (TRL patches its forward with a fused head)."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(trainer.model.config._name_or_path, dtype=torch.float32).eval()
    plain.load_state_dict(trainer.model.state_dict())
    return plain


def token_logps(model, ids):
    """log p of each token after the first, (T-1,)."""
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    return logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def shares(trainer, rows, sizes, num_items):
    """The sum of the micro-batches' shares of the loss (train mode, the step's global counts)."""
    trainer.model.train()
    total, at = 0.0, 0
    for size in sizes:
        batch = trainer._prepare_inputs(trainer.data_collator(rows[at:at + size]))
        with torch.no_grad():
            total += float(trainer.compute_loss(trainer.model, batch, num_items_in_batch=num_items))
        at += size
    return total


def test_orpo_loss_is_the_global_nll_mean_minus_the_mean_odds_ratio_term(tmp_path, spiky_model_dir):
    """NLL over every chosen token of the step (prompt and answer, TRL's choice) / their number - beta * mean over the
    pairs of logsigmoid(log odds(mean token log-prob of chosen) - log odds(rejected)): one batch of 4 pairs, and
    micro-batches of 1 and 3 with the step's counts, equal it; TRL's mean of the micro-batch means does not."""
    beta = 0.5
    trainer = build_trainer(tmp_path, spiky_model_dir, {"loss_type": "orpo", "beta": beta})
    rows = [trainer.train_dataset[i] for i in range(4)]
    plain = plain_model(trainer)
    nll, tokens, odds = 0.0, 0, []
    for r in rows:
        chosen = token_logps(plain, r["chosen_input_ids"])
        nll, tokens = nll - float(chosen.sum()), tokens + len(chosen)
        mean_logp = []
        for side in ("chosen", "rejected"):
            ids, labels = r[f"{side}_input_ids"], torch.tensor(r[f"{side}_labels"][1:])
            mean_logp.append(token_logps(plain, ids)[labels != -100].double().mean())
        lc, lr = mean_logp
        log_odds = (lc - lr) - (torch.log(-torch.expm1(lc)) - torch.log(-torch.expm1(lr)))
        odds.append(float(F.logsigmoid(log_odds)))
    want = nll / tokens - beta * sum(odds) / len(odds)
    counts = torch.tensor([4, tokens])
    within("orpo.loss_vs_formula.loss", shares(trainer, rows, [4], counts), want, label="one batch of 4")
    within("orpo.loss_vs_formula.loss", shares(trainer, rows, [1, 3], counts), want, label="micro-batches of 1 and 3")
    from trl.experimental.orpo import ORPOTrainer

    with torch.no_grad():
        trl = [float(ORPOTrainer.compute_loss(trainer, trainer.model, trainer._prepare_inputs(trainer.data_collator(
            part)))) for part in (rows[:1], rows[1:])]
    beyond("orpo.loss_vs_formula.loss", sum(trl) / 2, want)  # the micro-batches' lengths differ: TRL's average is off


@pytest.mark.parametrize("reference", ["copy", "precompute", "lora"])
def test_kto_kl_point_and_loss_are_over_the_whole_step(tmp_path, spiky_model_dir, reference):
    """z = max(0, mean over the step's 8 examples of log pi(y'|x) - log pi_ref(y'|x)), y' the completion TRL paired
    with x; the loss the mean over them of w (1 - sigmoid(beta (r - z))) (desirable) or w (1 - sigmoid(beta (z - r)))
    (undesirable): 4 micro-batches of 2 with the step's count give both, the reference a frozen copy, precomputed, or
    the LoRA policy with its adapter disabled; TRL's z, per micro-batch, differs."""
    from transformers import AutoModelForCausalLM

    beta, weights = 0.5, {True: 1.0, False: 1.5}
    trainer = build_trainer(tmp_path, spiky_model_dir, {"loss_type": "kto", "beta": beta, "undesirable_weight": 1.5,
                                                        "precompute_ref_log_probs": reference == "precompute"},
                            lora=4 if reference == "lora" else None)
    assert (trainer.ref_model is None) == (reference != "copy")
    torch.manual_seed(0)
    with torch.no_grad():  # the policy (its adapter, with LoRA) moves away from the reference: the model in the folder
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.add_((0.05 if reference != "lora" else 0.3) * torch.randn_like(p))
    rows = [trainer.train_dataset[i] for i in range(8)]
    policy = trainer.model.eval()  # its plain forward (TRL's loss uses a fused head)
    reference = AutoModelForCausalLM.from_pretrained(spiky_model_dir, dtype=torch.float32).eval()

    def logp(model, r, key):
        return float(token_logps(model, r["prompt_ids"] + r[key])[len(r["prompt_ids"]) - 1:].sum())

    kl = [logp(policy, r, "KL_completion_ids") - logp(reference, r, "KL_completion_ids") for r in rows]
    z = max(0.0, sum(kl) / len(kl))
    assert z > 0.05, kl  # so that the test can tell one z from another
    losses = []
    for r in rows:
        ratio = logp(policy, r, "completion_ids") - logp(reference, r, "completion_ids")
        margin = beta * (ratio - z) if r["label"] else beta * (z - ratio)
        losses.append(weights[r["label"]] * (1 - torch.sigmoid(torch.tensor(margin)).item()))
    micro = [trainer._prepare_inputs(trainer.data_collator(rows[i:i + 2])) for i in range(0, 8, 2)]
    trainer.step_kl = trainer._global_kl(micro)
    within("kto.step_kl_vs_formula.z", float(trainer.step_kl), z)
    within("kto.loss_vs_formula.loss", shares(trainer, rows, [2, 2, 2, 2], torch.tensor(8)), sum(losses) / 8)
    per_micro = [max(0.0, sum(kl[i:i + 2]) / 2) for i in range(0, 8, 2)]
    # TRL's z of a micro-batch alone
    beyond("kto.step_kl_vs_formula.z", per_micro, [z] * len(per_micro), label=f"per micro-batch {per_micro}")


@pytest.mark.parametrize("preference, tag", [({"loss_type": "orpo"}, "orpo"), ({"loss_type": "kto"}, "kto"),
                                             ({"loss_type": "ipo"}, "dpo"), ({}, "dpo"), (None, "sft")])
def test_the_card_is_tagged_with_the_method_that_trained_the_model(tmp_path, preference, tag):
    """A KTO or ORPO model's card was tagged `dpo` (issue 43): the tag is the method's (the Hub lists models by it)."""
    from hftrain.constants import RECIPE_FILE, RUN_INFO_FILE
    from hftrain.hub.card import build_card
    from hftrain.methods import load_recipe, method_of

    tree = {"model": {"name_or_path": "base"}, "data": {"sources": [{"path": "pairs.jsonl"}]},
            **({"preference": preference} if preference is not None else {})}
    recipe = load_recipe(None, raw=tree)
    (tmp_path / RECIPE_FILE).write_text(recipe.to_yaml())
    (tmp_path / RUN_INFO_FILE).write_text(json.dumps({"method": method_of(recipe).card(recipe)}))
    card = build_card(str(tmp_path), [RECIPE_FILE, RUN_INFO_FILE])
    assert tag in card.data.tags and ({"dpo", "orpo", "kto", "sft"} - {tag}).isdisjoint(card.data.tags)
