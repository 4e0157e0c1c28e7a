"""Outcome reward models (hftrain reward, methods/reward/): the `reward:` section's rules, the pairs of every layout,
the sequence classifier's pad token (batched scores equal one-at-a-time scores), refusals by check and run alike, the
loss as the exact mean over the pairs of the global batch (with its negative control), held-out pair accuracy, LoRA
and its merged export, and the card of a pushed reward model."""

import json
import os
import random

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig

from hftrain.config import ModelSection
from hftrain.data.split import split_rows
from hftrain.heads import Head
from hftrain.methods import parse_recipe
from hftrain.modeling import load_model
from hftrain.methods.reward.pair_scores import score_pairs

from tests.exactness import beyond, within

from .support import assert_resume_exact, resume_variants
from .conftest import PY, REPO, launch_prefix, run, run_matrix

BASE = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}, "reward": {}}
PAIRS_TRAIN = os.path.join(REPO, "data", "demo", "preference_train.jsonl")


def problems(*overrides):
    return parse_recipe(None, list(overrides), raw=json.loads(json.dumps(BASE)))[1]


# -- the reward: section ---------------------------------------------------------------------------------------
def test_the_sections_problems_come_at_once_naming_key_and_fix():
    found = problems("reward.kind=process", "reward.margin=m", "reward.center_rewards_coefficient=0",
                     "data.packing=true", "eval.exact_match=3", "reward.kindd=x")
    expected = ["reward.margin: applies to kind outcome, not process",
                "reward.center_rewards_coefficient: applies to kind outcome, not process",
                "reward.center_rewards_coefficient: must be a finite number > 0, got 0",
                "data.packing: applies to supervised fine-tuning, not to reward pairs",
                "eval.exact_match: is not measured by a reward model", "reward.kindd: unknown key"]
    for line in expected:
        assert any(line in p for p in found), (line, found)
    assert problems("reward.margin=strength", "reward.center_rewards_coefficient=0.01") == []
    assert any("strategy.name: reward modelling runs under ddp, fsdp, zero2, zero3" in p
               for p in problems("strategy.name=zero3_offload"))


# -- the pad token: the score at the last real token --------------------------------------------------------------
@pytest.fixture(scope="module")
def classifier_without_pad(tmp_path_factory, tiny_model_dir):
    """A folder whose tokenizer has no pad token (it has EOS) and whose config names a pad id of its own."""
    out = tmp_path_factory.mktemp("nopad") / "m"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    own_pad = tok.pad_token_id
    tok.pad_token = None
    tok.save_pretrained(out)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=None)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    return str(out), own_pad


def scores_batched_and_alone(model, tok, texts):
    batch = tok(texts, return_tensors="pt", padding=True)
    assert (batch["attention_mask"] == 0).any()  # the batch is padded
    with torch.no_grad():
        together = model(**batch).logits.squeeze(-1)
        alone = torch.cat([model(**tok([t], return_tensors="pt")).logits.squeeze(-1) for t in texts])
    return together, alone


@pytest.mark.parametrize("config_pad", ["none", "another token"])
def test_a_classifier_scores_the_last_real_token_in_a_padded_batch(classifier_without_pad, config_pad, capsys):
    """Loading a sequence-classification head sets config.pad_token_id from the tokenizer (which pads with EOS,
    said so): a padded batch scores as each row alone. Without it transformers refuses a batch (no pad id), or, with
    the config's pad id another token than the tokenizer's, reads the score at a padding position."""
    from hftrain.modeling import load_tokenizer

    folder, own_pad = classifier_without_pad
    if config_pad == "another token":
        config = json.load(open(os.path.join(folder, "config.json")))
        folder = folder + "_own_pad"
        AutoModelForSequenceClassification.from_pretrained(os.path.dirname(folder) + "/m").save_pretrained(folder)
        AutoTokenizer.from_pretrained(os.path.dirname(folder) + "/m").save_pretrained(folder)
        json.dump({**config, "pad_token_id": own_pad}, open(os.path.join(folder, "config.json"), "w"))
    model = load_model(ModelSection(name_or_path=folder, dtype="float32"), head=Head.SEQUENCE_CLASSIFICATION).eval()
    said = capsys.readouterr().err
    tok = load_tokenizer(ModelSection(name_or_path=folder))
    together, alone = scores_batched_and_alone(model, tok, ["a b c d e f g h", "a b", "c d e"])
    within("reward.padded_batch_vs_alone.scores", together, alone, label=config_pad, scale=1.0)
    assert model.config.pad_token_id == tok.pad_token_id == tok.eos_token_id
    assert "the tokenizer has no pad token; it pads with its eos token" in said


# -- the pairs of every layout ------------------------------------------------------------------------------------
def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_every_pair_layout_reads_and_tokenises_as_trl(tmp_path, tiny_model_dir):
    from hftrain.launch import check_data
    from hftrain.methods.reward.reward_pairs import show_pairs

    text = write_rows(tmp_path / "text.jsonl", [{"prompt": "2+2=", "chosen": "4", "rejected": "5", "strength": 2}] * 4)
    user = [{"role": "user", "content": "reverse: a b"}]
    implicit = write_rows(tmp_path / "implicit.jsonl", [
        {"chosen": user + [{"role": "assistant", "content": "b a"}],
         "rejected": user + [{"role": "assistant", "content": "a b"}]}] * 3)
    explicit = write_rows(tmp_path / "explicit.jsonl", [
        {"prompt": user, "chosen": [{"role": "assistant", "content": "b a"}],
         "rejected": [{"role": "assistant", "content": "b b"}], "strength": 0.5}] * 5)

    def read(sources, **reward):
        recipe, found = parse_recipe(None, [], raw={
            "model": {"name_or_path": tiny_model_dir}, "reward": reward,
            "data": {"sources": sources, "max_length": 64}, "training": {"output_dir": str(tmp_path / "o")}})
        assert found == []
        return recipe, check_data(recipe, 1)

    recipe, (tok, data) = read([{"path": text}], margin="strength")
    assert data.train["margin"] == [2.0] * 4 and tok.decode(data.train[0]["chosen_ids"]).startswith("2+2=4")
    recipe, (tok, data) = read([{"path": implicit}, {"path": explicit, "weight": 2}])  # mixing conversations
    rejected = {tok.decode(ids) for ids in data.train["rejected_ids"]}
    assert len(rejected) == 2 and all("reverse: a b" in r for r in rejected)  # both sources, each with its prompt
    chosen = tok.decode(data.train[0]["chosen_ids"])
    assert "reverse: a b" in chosen and "b a" in chosen  # prompt + answer, with the chat template
    shown = [json.loads(line) for line in show_pairs(recipe, tok, 2).splitlines()]
    assert len(shown) == 2 and shown[0]["chosen_tokens"] == len(data.train[0]["chosen_ids"])


# -- refusals: check and run alike --------------------------------------------------------------------------------
@pytest.mark.launches
def test_check_and_run_refuse_a_missing_side_and_a_tokenizer_with_no_pad_token(tmp_path, classifier_without_pad):
    folder = str(tmp_path / "nothing")
    tok = AutoTokenizer.from_pretrained(classifier_without_pad[0])
    tok.eos_token = tok.unk_token = tok.pad_token = None
    tok.save_pretrained(folder)
    AutoModelForSequenceClassification.from_pretrained(classifier_without_pad[0]).save_pretrained(folder)
    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                                {"prompt": "a", "chosen": "b"}])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({"model": {"name_or_path": folder}, "data": {"sources": [{"path": rows}]},
                                  "reward": {}, "training": {"output_dir": str(tmp_path / "out")}}))
    for cmd in ([PY, "-m", "hftrain.cli", "check", str(recipe)], [PY, "recipes/reward.py", str(recipe)]):
        r = run(cmd, timeout=240)
        said = r.stdout + r.stderr
        assert r.returncode == 2 and "Traceback" not in said, said[-3000:]
        assert "the tokenizer has no pad, eos or unk token" in said, said[-3000:]
        assert f"data.sources.0: {rows}:2: no 'rejected' column" in said, said[-3000:]
        assert "model.name_or_path: the tokenizer has no pad, eos or unk token" in said, said[-3000:]


# -- exact over ranks and accumulation; held-out metrics; LoRA; the card ------------------------------------------
def uneven_pairs(path, n, seed=0):
    """Conversation pairs whose answers are 1 to 12 letters long: very uneven lengths within every batch."""
    rng = random.Random(seed)

    def word(k):
        return " ".join(rng.choice("abcdefghij") for _ in range(k))
    rows = [{"prompt": [{"role": "user", "content": f"reverse: {word(3)}"}],
             "chosen": [{"role": "assistant", "content": word(rng.choice([1, 2, 8, 12]))}],
             "rejected": [{"role": "assistant", "content": word(rng.choice([1, 3, 12]))}]} for _ in range(n)]
    return write_rows(path, rows)


LORA = {"r": 4, "alpha": 8, "dropout": 0.0}  # no dropout: its masks would differ between 1 and 2 ranks


def plan(tmp, name, model_dir, rows, bs, ga, steps, module="hftrain.recipes.reward", reward=None, **extra):
    """One variant of a matrix launch: `hftrain reward` (or a test driver) on its own recipe, in tmp/name; plain SGD
    in fp32, so that the weights follow the losses' gradients exactly."""
    training = {"output_dir": str(tmp / name), "max_steps": steps, "per_device_train_batch_size": bs,
                "gradient_accumulation_steps": ga, "optim": "sgd", "learning_rate": 0.1,
                "lr_scheduler_type": "constant", "max_grad_norm": 0.0, "weight_decay": 0.0, "save_strategy": "no",
                "train_sampling_strategy": "sequential", "logging_steps": 1, "seed": 0, "report_to": "none",
                **extra.pop("training", {})}
    recipe = {"model": {"name_or_path": model_dir, "dtype": "float32", **extra.pop("model", {})},
              "data": {"sources": [{"path": str(rows)}], "max_length": 64, **extra.pop("data", {})},
              "reward": reward or {"center_rewards_coefficient": 0.1}, "training": training, **extra}
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(recipe))
    return module, [str(path)]


def outcome(variant, out, world, strategy="ddp"):
    """(losses, final weights) of a variant's run, after checking it ran where it should."""
    variant.check()
    info = json.load(open(out / "run_info.json"))
    assert info["world_size"] == world and info["strategy"] == strategy
    assert info.get("zero_stage") == {"zero3": 3}.get(strategy)
    history = json.load(open(out / "trainer_state.json"))["log_history"]
    return [h["loss"] for h in history if "loss" in h], load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, spiky_model_dir, tiny_model_dir):
    """Every one-process run of this module in one launch (tests/matrix_worker.py)."""
    tmp = tmp_path_factory.mktemp("reward_one_rank")
    six, sixteen = uneven_pairs(tmp / "six.jsonl", 6), uneven_pairs(tmp / "sixteen.jsonl", 16)
    demo = tmp / "demo.jsonl"
    with open(PAIRS_TRAIN) as fh:
        demo.write_text("".join(next(fh) for _ in range(96)))
    variants = {
        "bs6": plan(tmp, "bs6", spiky_model_dir, six, 6, 1, 1),
        "bs4_ga2": plan(tmp, "bs4_ga2", spiky_model_dir, six, 4, 2, 1),
        "bs4_ga2_mean_of_means": plan(tmp, "bs4_ga2_mean_of_means", spiky_model_dir, six, 4, 2, 1,
                                      module="tests.reward_mean_of_means"),
        "1x_ga4": plan(tmp, "1x_ga4", spiky_model_dir, sixteen, 2, 4, 2),
        "full": plan(tmp, "full", tiny_model_dir, demo, 8, 1, 8, reward={}, data={"eval_fraction": 0.25},
                     training={"learning_rate": 0.05, "per_device_eval_batch_size": 5}),
        "lora": plan(tmp, "lora", tiny_model_dir, demo, 8, 1, 2, reward={},
                     model={"lora": {"r": 4, "alpha": 8, "merge": True}}),
        **resume_variants(plan, tmp, spiky_model_dir, sixteen),
        "1x_ga4_lora": plan(tmp, "1x_ga4_lora", spiky_model_dir, sixteen, 2, 4, 2, model={"lora": LORA}),
    }
    return tmp, run_matrix(launch_prefix(1), variants, tmp / "matrix", timeout=900), sixteen


@pytest.mark.launches
def test_unequal_micro_batches_give_the_global_pair_mean_and_the_control_differs(one_rank):
    """6 pairs in one step: micro-batches of 4 and 2 (GA2) train as one batch of 6. TRL alone returns each
    micro-batch's mean and the Trainer averages the two (the negative control): the short one's pairs weigh double."""
    tmp, variants, _ = one_rank
    one_loss, one_weights = outcome(variants["bs6"], tmp / "bs6", 1)
    acc_loss, acc = outcome(variants["bs4_ga2"], tmp / "bs4_ga2", 1)
    within("reward.accumulated_vs_one_batch.loss", acc_loss, one_loss)
    within("reward.accumulated_vs_one_batch.weights", acc, one_weights)
    control_loss, control = outcome(variants["bs4_ga2_mean_of_means"], tmp / "bs4_ga2_mean_of_means", 1)
    beyond("reward.accumulated_vs_one_batch.loss", control_loss, one_loss)
    beyond("reward.accumulated_vs_one_batch.weights", control, one_weights)


@pytest.mark.launches
@pytest.mark.parametrize("kind", ["whole", "lora"])
def test_a_resumed_outcome_reward_model_ends_where_the_uninterrupted_run_ends(one_rank, kind):
    """Its checkpoint was refused by the recipe that wrote it ('score.weight [1, 128] there, [2, 128] here'): now it
    resumes, and steps 3-4 from checkpoint-2 (weights, AdamW state, data position) equal the uninterrupted run's;
    resuming the weights alone (a fresh optimizer) is the control."""
    tmp, variants, _ = one_rank
    assert_resume_exact(tmp, variants, kind, "reward")


@pytest.mark.launches
def test_a_lora_reward_model_passes_the_upload_checks_and_its_card_loads_it(one_rank, tmp_path, monkeypatch):
    """The upload check built the adapter's base with the base config's 2 labels and refused every LoRA outcome
    reward model; the card's snippet did the same. Both build it with the run's one score now."""
    from hftrain.config import HubSection
    from hftrain.hub.push import push

    tmp, variants, _ = one_rank
    variants["lora"].check()
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    for merge in (False, True):
        stage = push(str(tmp / "lora"), HubSection(repo_id="me/rm-lora", merge_lora=merge), dry_run=True,
                     stage_dir=str(tmp_path / f"stage_{merge}"))
        card = open(os.path.join(stage, "README.md")).read()
        assert ("num_labels=1" in card) != merge and "apply_chat_template(messages" in card, card


@pytest.mark.launches
def test_held_out_pair_accuracy_and_margin_before_and_after(one_rank):
    tmp, variants, _ = one_rank
    variants["full"].check()
    info = json.load(open(tmp / "full" / "run_info.json"))
    metrics = info.get("metrics", info)
    for key in ("eval_pair_accuracy", "eval_mean_margin"):
        assert f"initial_{key}" in json.dumps(metrics) and f"final_{key}" in json.dumps(metrics), metrics
    assert "hftrain: eval_pair_accuracy: before" in variants["full"].stdout


@pytest.mark.launches
def test_hftrain_score_gives_the_runs_own_held_out_figures(one_rank, tmp_path):
    """`hftrain score` (methods/reward/pair_scores.py) of the trained run on the rows it held out (data.eval_fraction:
    the split remade by data/split.py's rule) gives the run's final eval_pair_accuracy and eval_mean_margin."""
    tmp, variants, _ = one_rank
    variants["full"].check()
    seed = yaml.safe_load(open(tmp / "full" / "recipe.yaml"))["training"]["seed"]
    rows = (tmp / "demo.jsonl").read_text().splitlines()
    _, held = split_rows(len(rows), 0.25, seed, "data.sources.0", "demo.jsonl")
    path = tmp_path / "held.jsonl"
    path.write_text("".join(rows[i] + "\n" for i in held))
    scores, _ = score_pairs(str(tmp / "full"), str(path), device="cpu")
    metrics = json.load(open(tmp / "full" / "run_info.json"))["metrics"]
    assert scores["all"].pairs == len(held) == 24
    assert scores["all"].pair_accuracy == pytest.approx(metrics["final_eval_pair_accuracy"], abs=1e-6)
    within("reward.padded_batch_vs_alone.scores", scores["all"].mean_margin, metrics["final_eval_mean_margin"],
           label="hftrain score vs the run's held-out mean margin")


@pytest.mark.launches
def test_lora_trains_and_saves_the_score_head_and_its_merge_loads(one_rank):
    tmp, variants, _ = one_rank
    variants["lora"].check()
    out = tmp / "lora"
    adapter = load_file(str(out / "adapter_model.safetensors"))
    assert any("score" in k for k in adapter), list(adapter)  # modules_to_save: the head is saved whole
    merged = AutoModelForSequenceClassification.from_pretrained(str(out / "merged")).eval()
    tok = AutoTokenizer.from_pretrained(str(out / "merged"))
    assert merged.config.num_labels == 1 and merged.config.pad_token_id == tok.pad_token_id
    together, alone = scores_batched_and_alone(merged, tok, ["a b c d e f g h", "a b"])
    within("reward.padded_batch_vs_alone.scores", together, alone, label="merged LoRA", scale=1.0)


@pytest.mark.launches
def test_a_pushed_reward_model_names_its_auto_class_and_loads_with_it(one_rank, tmp_path, monkeypatch):
    from hftrain.config import HubSection
    from hftrain.hub.push import push

    tmp, variants, _ = one_rank
    variants["full"].check()
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    stage = push(str(tmp / "full"), HubSection(repo_id="me/rm"), dry_run=True)
    card = open(os.path.join(stage, "README.md")).read()
    assert "pipeline_tag: text-classification" in card and "AutoModelForSequenceClassification" in card, card
    assert "outcome reward modelling" in card
    model = AutoModelForSequenceClassification.from_pretrained(stage)
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory, spiky_model_dir, one_rank):
    """2 ranks x GA2 (micro-batch 2, 8 pairs a step) of the 16 uneven pairs, one launch per strategy."""
    launches = {}

    def get(strategy):
        if strategy not in launches:
            if strategy.startswith("zero"):
                request.getfixturevalue("deepspeed_ops")
            tmp = tmp_path_factory.mktemp(f"reward_two_ranks_{strategy}")
            variants = {"2x_ga2": plan(tmp, "2x_ga2", spiky_model_dir, one_rank[2], 2, 2, 2),
                        "2x_ga2_lora": plan(tmp, "2x_ga2_lora", spiky_model_dir, one_rank[2], 2, 2, 2,
                                            model={"lora": LORA})}
            launches[strategy] = tmp, run_matrix(launch_prefix(2, strategy), variants, tmp / "matrix", ranks=2,
                                                 timeout=900)
        return launches[strategy]

    return get


@pytest.mark.launches
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_two_ranks_ga2_equal_one_rank_ga4(one_rank, two_ranks, strategy):
    """2 ranks x GA2 give 1 rank x GA4's losses and weights over two steps (fp32, rel 1e-5)."""
    tmp1, variants1, _ = one_rank
    ref_loss, ref = outcome(variants1["1x_ga4"], tmp1 / "1x_ga4", 1)
    tmp, variants = two_ranks(strategy)
    losses, final = outcome(variants["2x_ga2"], tmp / "2x_ga2", 2, strategy)
    within("reward.two_ranks_vs_one.losses", losses, ref_loss, label=strategy)
    within("reward.two_ranks_vs_one.weights", final, ref, label=strategy)


@pytest.mark.launches
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_a_lora_reward_model_on_two_ranks_equals_one_rank(one_rank, two_ranks, strategy):
    """A LoRA outcome reward model (the adapter and its score head, trained whole: modules_to_save) was tested on one
    rank only: 2 ranks x GA2 under DDP, FSDP2 and ZeRO-3 give 1 rank x GA4's losses and adapter. (Every micro-batch
    here holds 2 pairs, so the per-micro-batch mean would agree too: its control is that of
    test_unequal_micro_batches_give_the_global_pair_mean_and_the_control_differs, on uneven micro-batches.)"""
    tmp1, variants1, _ = one_rank
    tmp, variants = two_ranks(strategy)
    runs = {}
    for folder, found, name in ((tmp1, variants1, "1x_ga4_lora"), (tmp, variants, "2x_ga2_lora")):
        found[name].check()
        history = json.load(open(folder / name / "trainer_state.json"))["log_history"]
        runs[name] = ([h["loss"] for h in history if "loss" in h],
                      load_file(str(folder / name / "adapter_model.safetensors")))
    (ref_loss, ref), (losses, adapter) = runs["1x_ga4_lora"], runs["2x_ga2_lora"]
    assert any(".score." in k for k in adapter)  # the head, saved whole with the adapter
    within("reward.lora_two_ranks_vs_one.losses", losses, ref_loss, label=strategy)
    within("reward.lora_two_ranks_vs_one.weights", adapter, ref, label=strategy)
