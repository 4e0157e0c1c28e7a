"""A trained reward model as GRPO's reward (`grpo.rewards: [{model: FOLDER}]`, hftrain/methods/reward_model.py):
its scores are a plain AutoModelForSequenceClassification forward of the same tokens, batched or one at a time (the
pad token: the score is read at the last real token); the text it reads (the policy's own tokens, or the
conversation rendered again with its own tokenizer); what `hftrain check` and the run refuse, naming the key; one GRPO
run with the reward model as its only reward, its metric logged."""

import json

import pytest
import torch
import yaml
from transformers import AutoModelForTokenClassification, LlamaConfig

from hftrain.config import ModelSection
from hftrain.errors import RewardError, exit_on_user_error
from hftrain.heads import Head
from hftrain.methods import GrpoSection, RewardSpec, parse_recipe
from hftrain.methods.reward_model import RewardModel
from hftrain.methods.grpo.rewards import ModelReward, Policy, load_rewards
from hftrain.tiny import train_tokenizer

from tests.exactness import beyond, within

from .conftest import DEMO_TRAIN, PY, SMALL, run

KEY = "grpo.rewards.0.model"
PROMPT = [{"role": "user", "content": "reverse: a b c"}]


def save_classifier(path, tokenizer, pad_in_config=False, labels=1, head=Head.SEQUENCE_CLASSIFICATION, seed=0):
    """A tiny Llama classifier with random weights and `tokenizer`, saved to `path`; config.pad_token_id unset unless
    `pad_in_config` (a base config without a pad id, as many reward models' bases have)."""
    cfg = LlamaConfig(vocab_size=len(tokenizer), num_labels=labels, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=None, pad_token_id=tokenizer.pad_token_id if pad_in_config else None, **SMALL)
    torch.manual_seed(seed)
    model = head.auto_class.from_config(cfg)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return str(path)


def save_prm(path, tokenizer, separator="\n", labels=2, seed=3):
    """A tiny token classifier with two labels and random weights (its head scaled up, so that steps score apart),
    with the recipe.yaml a process reward run writes beside it (`separator`: its reward.step_separator; None: none)."""
    save_classifier(path, tokenizer, labels=labels, head=Head.TOKEN_CLASSIFICATION, seed=seed)
    model = AutoModelForTokenClassification.from_pretrained(str(path))
    with torch.no_grad():
        model.score.weight.mul_(4)
    model.save_pretrained(str(path), safe_serialization=True)
    if separator is not None:
        recipe, found = parse_recipe(None, [], raw={
            "model": {"name_or_path": "base"}, "reward": {"kind": "process", "step_separator": separator},
            "data": {"sources": [{"path": "steps.jsonl"}]}, "training": {"output_dir": str(path)}})
        assert found == []
        (path / "recipe.yaml").write_text(recipe.to_yaml())  # as artifacts.write_recipe writes it
    return str(path)


def scorer(path, policy_tokenizer, conversational=True):
    return RewardModel(str(path), KEY, policy_tokenizer, None, conversational,
                       ModelSection(name_or_path="policy", dtype="float32"))


def direct(path, rows):
    """Each row scored alone by the saved classifier as transformers loads it (no padding anywhere)."""
    model = Head.SEQUENCE_CLASSIFICATION.auto_class.from_pretrained(str(path)).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([r])).logits[0, 0].item() for r in rows]


@pytest.fixture(scope="module")
def rm(tmp_path_factory, tokenizer):
    return save_classifier(tmp_path_factory.mktemp("rm") / "rm", tokenizer)


# -- the scores ----------------------------------------------------------------------------------------------------
def test_batched_scores_equal_one_at_a_time_forwards(rm, tokenizer):
    """The pad-token case: the folder's config has no pad_token_id; without it set from the tokenizer, transformers
    refuses any batch of two (or, with another pad id, reads a pad position)."""
    rows = [tokenizer(t)["input_ids"] for t in ("a", "reverse: a b c d e", "b a", "c b a c b a c b a")]
    s = scorer(rm, tokenizer)
    got = s.score_ids(rows)
    expected = direct(rm, rows)
    assert len(set(expected)) == 4
    within("grpo_reward_model.scorer_vs_alone.scores", got, expected, scale=1.0)
    width = max(map(len, rows))  # left padding reads the same last real token (relative positions: rotary)
    ids = torch.tensor([[s.pad_token_id] * (width - len(r)) + r for r in rows])
    with torch.no_grad():
        left = s.model(input_ids=ids, attention_mask=(ids != s.pad_token_id).long()).logits[:, 0].tolist()
    within("grpo_reward_model.left_padded_vs_alone.scores", left, expected, scale=1.0)
    assert not s.model.training and not any(p.requires_grad for p in s.model.parameters())


def test_the_same_tokenizer_scores_the_policys_own_tokens(rm, tokenizer):
    s = scorer(rm, tokenizer)
    assert s.same
    rendered = s.render([PROMPT], ["c b a"])
    assert rendered == [tokenizer(tokenizer.apply_chat_template(
        PROMPT + [{"role": "assistant", "content": "c b a"}], tokenize=False), add_special_tokens=False)["input_ids"]]
    own = [tokenizer("reverse: a b")["input_ids"], tokenizer("a b c")["input_ids"]]
    s.rollout_ids = own  # as GroupTrainer hands them over: the prompts' text is then not read
    end = tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]  # cut short: the template's turn end added
    within("grpo_reward_model.scorer_vs_alone.scores", s([PROMPT, PROMPT], ["x", "y"]),
           direct(rm, [r + end for r in own]), scale=1.0)


def test_a_rollout_is_scored_as_the_reward_model_read_the_conversation_in_training(rm, tokenizer):
    """A reward model trained on conversations (TRL renders prompt + answer with the chat template: `...<|im_end|>`
    then `\\n`) reads its score at the template's end of the turn; the policy's rollout ends at its EOS, or earlier
    when cut at max_completion_length. Both are scored as the whole conversation rendered (without the completion of
    the turn end, the score is read at the EOS: another number)."""
    s = scorer(rm, tokenizer)
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answers = ["c b a", "c b"]
    rendered = [tokenizer(tokenizer.apply_chat_template(PROMPT + [{"role": "assistant", "content": a}], tokenize=False),
                          add_special_tokens=False)["input_ids"] for a in answers]
    ended = prompt_ids + tokenizer(answers[0], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    cut = prompt_ids + tokenizer(answers[1], add_special_tokens=False)["input_ids"]
    assert rendered[0][:len(ended)] == ended and rendered[1][:len(cut)] == cut  # the same tokens, up to the EOS
    s.rollout_ids = [ended, cut]
    expected = direct(rm, rendered)
    within("grpo_reward_model.scorer_vs_alone.scores", s([PROMPT, PROMPT], answers), expected, scale=1.0)
    # the EOS position: another score
    beyond("grpo_reward_model.scorer_vs_alone.scores", direct(rm, [ended])[0], expected[0], scale=1.0)


def test_another_tokenizer_renders_the_conversation_with_its_own_template(tmp_path, tokenizer, capsys):
    other = train_tokenizer(["reverse: a b c", "c b a", "something else entirely"] * 20, vocab_size=280)
    path = save_classifier(tmp_path / "other", other, pad_in_config=True)
    s = scorer(path, tokenizer)
    assert not s.same
    s.rollout_ids = [tokenizer("reverse: a b")["input_ids"]]  # the policy's tokens mean nothing to it: not used
    text = other.apply_chat_template(PROMPT + [{"role": "assistant", "content": "c b a"}], tokenize=False)
    within("grpo_reward_model.scorer_vs_alone.scores", s([PROMPT], ["c b a"]),
           direct(path, [other(text, add_special_tokens=False)["input_ids"]]), scale=1.0)
    assert s([[*PROMPT]], [[{"role": "assistant", "content": "c b a"}]]) == s([PROMPT], ["c b a"])
    scorer(path, tokenizer)
    assert capsys.readouterr().out.count("tokenizer differs from the policy's") == 1  # said once

    other.chat_template = None
    bare = save_classifier(tmp_path / "bare", other, pad_in_config=True)
    with pytest.raises(RewardError, match=f"{KEY}: .* differs from the policy's .* has no chat template"):
        scorer(bare, tokenizer)
    assert not scorer(bare, tokenizer, conversational=False).same  # a text prompt is the text: no template needed


def test_a_template_that_refuses_the_conversation_is_a_reward_error_raised_on_every_rank(tmp_path, tokenizer):
    strict = train_tokenizer(["a b c"] * 20, vocab_size=270,
                             chat_template="{{ raise_exception('roles must alternate') }}")
    path = save_classifier(tmp_path / "strict", strict, pad_in_config=True)
    policy = Policy(tokenizer, None, True, ModelSection(name_or_path="p", dtype="float32"))
    reward = load_rewards(GrpoSection(rewards=[RewardSpec(model=path)]), defer=True, policy=policy)[0]
    assert reward([PROMPT], ["c b a"]) == [None]  # deferred: GroupTrainer raises it on every rank after the gather
    assert reward.error.startswith(f"{KEY}: the chat template refused the conversation: roles must alternate")


def test_a_reward_model_without_a_pad_token_is_refused_naming_the_folder(tmp_path, tokenizer):
    no_pad = train_tokenizer(["a b c"] * 20, vocab_size=270)
    no_pad.pad_token = None
    path = save_classifier(tmp_path / "nopad", no_pad)
    with pytest.raises(RewardError, match=f"{KEY}: {path} has no pad token"):
        scorer(path, tokenizer)


def test_a_model_reward_plugs_into_the_rewards(rm, tokenizer):
    g = GrpoSection(rewards=[RewardSpec("exact_match"), RewardSpec(model=rm, weight=2.0), RewardSpec(model=rm)])
    rewards = load_rewards(g, policy=Policy(tokenizer, None, True, ModelSection(name_or_path="p", dtype="float32")))
    assert [r.__name__ for r in rewards] == ["exact_match", "model:rm", "model:rm_2"]
    assert isinstance(rewards[1], ModelReward)
    values = rewards[1]([PROMPT], ["c b a"], completion_ids=[[1]], reference=["c b a"])
    within("grpo_reward_model.scorer_vs_alone.scores", values, direct(rm, rewards[1].fn.render([PROMPT], ["c b a"])),
           scale=1.0)


# -- the refusals: `hftrain check` and the run alike -----------------------------------------------------------------
@pytest.fixture(scope="module")
def misfits(tmp_path_factory, tokenizer, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("misfits")
    return {"missing": str(tmp / "nowhere"), "causal": tiny_model_dir,
            "two": save_classifier(tmp / "two", tokenizer, labels=2),
            "process": save_classifier(tmp / "prm", tokenizer, head=Head.TOKEN_CLASSIFICATION)}


def grpo_recipe(tmp_path, model, rewards, **training):
    tree = {"model": {"name_or_path": model, "dtype": "float32"},
            "data": {"sources": [{"path": DEMO_TRAIN}], "max_length": 48},
            "grpo": {"rewards": rewards, "num_generations": 2, "max_completion_length": 8},
            "eval": {"exact_match": 0},
            "training": {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2, "report_to": "none",
                         "disable_tqdm": True, "logging_steps": 1, **training}}
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump(tree))
    return str(rec)


def test_check_refuses_a_reward_model_that_is_damaged_or_too_large_for_the_plan(tmp_path, rm, tiny_model_dir):
    """Reward models are models the method holds (GRPO.models): their folders are checked as the policy's (a
    truncated model.safetensors passed check, the run refused it after the policy loaded) and the fit check counts
    them whole on every rank (a 70B-shaped one passed check on a small machine, the same folder was refused as a
    teacher); the reward model as it is passes (the control)."""
    import shutil

    from hftrain.config import RecipeError
    from hftrain.launch.preflight import check_recipe

    cut = shutil.copytree(rm, tmp_path / "cut")
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(RecipeError, match=r"grpo.rewards.0.model.name_or_path: .*model.safetensors"):
        check_recipe(grpo_recipe(tmp_path, tiny_model_dir, [{"model": str(cut)}]))
    huge = shutil.copytree(rm, tmp_path / "huge")
    config = json.load(open(huge / "config.json"))
    (huge / "config.json").write_text(json.dumps({**config, "hidden_size": 8192, "intermediate_size": 28672,
                                                  "num_hidden_layers": 80, "num_attention_heads": 64,
                                                  "num_key_value_heads": 8, "head_dim": 128}))
    with pytest.raises(RecipeError, match=r"grpo.rewards.0.model: .* does not fit the memory plan"):
        check_recipe(grpo_recipe(tmp_path, tiny_model_dir, [{"model": str(huge)}]))
    check_recipe(grpo_recipe(tmp_path, tiny_model_dir, [{"model": rm}]))


def test_check_and_the_run_refuse_what_cannot_score(tmp_path, misfits, rm, tiny_model_dir, capsys):
    from hftrain.cli import main as cli_main
    from hftrain.recipes import grpo

    rec = grpo_recipe(tmp_path, tiny_model_dir, [
        {"model": misfits["missing"]}, {"model": misfits["causal"]}, {"model": misfits["two"]},
        {"model": misfits["process"]}, {"model": rm, "function": "exact_match"}, {"weight": 1.0},
        {"model": rm, "pattern": "x"}])
    expected = [f"grpo.rewards.0.model: {misfits['missing']} is not a folder",
                f"grpo.rewards.1.model: {misfits['causal']} is not a sequence classifier (architectures: "
                "['LlamaForCausalLM'])",
                f"grpo.rewards.2.model: {misfits['two']} has 2 labels; a reward model scores with one",
                f"grpo.rewards.3.model: {misfits['process']} is a token-classification (process) reward model",
                "grpo.rewards.4: needs exactly one of `function` (a built-in or your own) and `model` (a reward "
                "model's folder), got both",
                "grpo.rewards.5: needs exactly one of", "got neither",
                "grpo.rewards.6.pattern: applies to function regex, not a reward model"]
    for command in (lambda: cli_main(["check", rec]), lambda: grpo.main([rec])):
        with pytest.raises(SystemExit) as e, exit_on_user_error():
            command()
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err, err
        assert all(m in err for m in expected), err
    assert not (tmp_path / "out").exists()


# -- a run ---------------------------------------------------------------------------------------------------------
@pytest.mark.launches
def test_a_grpo_run_with_reward_models_as_its_rewards(tmp_path, rm, tiny_model_dir, tokenizer):
    """Two steps of 2 prompts x 2 completions, rewarded by the reward models alone: the outcome one (weight 2) and a
    process one (aggregate min, its separator read from the recipe.yaml of its training run): each metric is logged
    per step as rewards/model:<name>/mean and the step's reward is their weighted sum (TRL's)."""
    prm = save_prm(tmp_path / "prm", tokenizer)
    rec = grpo_recipe(tmp_path, tiny_model_dir, [{"model": rm, "weight": 2.0}, {"model": prm, "aggregate": "min"}],
                      max_steps=2, per_device_train_batch_size=4, save_strategy="no")
    r = run([PY, "recipes/grpo.py", rec], timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "differs from the policy's" not in r.stdout  # the same tokenizer: the policy's own tokens are scored
    logged = [h for h in json.load(open(tmp_path / "out" / "trainer_state.json"))["log_history"] if "loss" in h]
    assert len(logged) == 2, logged
    for h in logged:
        outcome, process = h["rewards/model:rm/mean"], h["rewards/model:prm/mean"]
        assert outcome != 0 and 0 < process < 1, h
        within("grpo_reward_model.logged_reward_vs_weighted_sum.reward", h["reward"], 2 * outcome + process,
               label=str(h), scale=1.0)
        assert "rewards/model:rm/std" in h and "rewards/model:prm/std" in h
