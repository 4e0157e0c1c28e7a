"""A process reward model as GRPO's reward (`grpo.rewards: [{model: FOLDER, aggregate: min | last}]`,
hftrain/methods/process_reward_model.py): its scores equal a plain AutoModelForTokenClassification forward read
at the step separators found by hand (min and last), batched or one at a time; a completion is tokenised as the PRM's
data phase tokenised its training rows; its separator read from its training run's recipe.yaml; what `hftrain check`
and the run refuse, naming the key. The run with a PRM as a reward: tests/test_grpo_reward_model.py (one launch)."""

import pytest
import torch
from transformers import AutoModelForTokenClassification

from hftrain.config import ModelSection
from hftrain.errors import RewardError, exit_on_user_error
from hftrain.methods import GrpoSection, RewardSpec
from hftrain.methods.process_reward_model import ProcessRewardModel
from hftrain.methods.grpo.rewards import Policy, load_rewards
from hftrain.methods.reward.step_rows import tokenised_steps

from tests.exactness import beyond, within

from .test_grpo_reward_model import PROMPT, grpo_recipe, save_classifier, save_prm

KEY = "grpo.rewards.0.model"


@pytest.fixture(scope="module")
def prm(tmp_path_factory, tokenizer):
    return save_prm(tmp_path_factory.mktemp("prm") / "prm", tokenizer)


def scorer(path, tokenizer, aggregate):
    policy = Policy(tokenizer, None, True, ModelSection(name_or_path="policy", dtype="float32"))
    return load_rewards(GrpoSection(rewards=[RewardSpec(model=path, aggregate=aggregate)]), policy=policy)[0]


def by_hand(path, tokenizer, prompt, steps):
    """The probability of label 1 at each separator of prompt + steps, each row alone through transformers: the
    separators are the newline tokens after the prompt's (the tokenizer keeps "\\n" a token of its own)."""
    head = (tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            if isinstance(prompt, list) else prompt)
    before = len(tokenizer(head, add_special_tokens=False)["input_ids"])
    ids = tokenizer(head + "".join(s + "\n" for s in steps), add_special_tokens=False)["input_ids"]
    newline = tokenizer.convert_tokens_to_ids("Ċ")
    at = [i for i in range(before, len(ids)) if ids[i] == newline]
    assert len(at) == len(steps)
    model = AutoModelForTokenClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, at].softmax(-1)[:, 1].tolist()


CASES = [(PROMPT, "c b a\nso the answer is c b a"), ("reverse: a b", "b\na\nb a"), (PROMPT, "c b a"),
         (PROMPT, [{"role": "assistant", "content": "c\n\nb a\n"}])]
STEPS = [["c b a", "so the answer is c b a"], ["b", "a", "b a"], ["c b a"], ["c", "b a"]]


def test_scores_equal_a_token_classifier_read_at_the_separators_by_hand_min_and_last(prm, tokenizer):
    """min: the weakest step; last: the last step's; batched (right-padded rows of different lengths) as one at a
    time; blank pieces between separators are no steps, the last step ends with the separator too."""
    steps = [by_hand(prm, tokenizer, p, s) for (p, _), s in zip(CASES, STEPS)]
    # the last step is neither always the weakest nor always the strongest: min, last (and not max) are told apart
    # (the controls: the wrong aggregate differs by more than the bound)
    beyond("grpo_process_reward.batched_vs_alone.scores", min(steps[0]), steps[0][-1], label="min for last", scale=1.0)
    beyond("grpo_process_reward.batched_vs_alone.scores", max(steps[1]), steps[1][-1], label="max for last", scale=1.0)
    prompts, completions = [p for p, _ in CASES], [c for _, c in CASES]
    for aggregate, expected in (("min", [min(s) for s in steps]), ("last", [s[-1] for s in steps])):
        reward = scorer(prm, tokenizer, aggregate)
        assert isinstance(reward.fn, ProcessRewardModel)
        got = reward(prompts, completions)
        within("grpo_process_reward.batched_vs_alone.scores", got, expected, scale=1.0,
               label=f"{aggregate}: batched against by hand")
        alone = [reward([p], [c])[0] for p, c in zip(prompts, completions)]
        within("grpo_process_reward.batched_vs_alone.scores", alone, got, scale=1.0,
               label=f"{aggregate}: one at a time against batched")
    blank = reward([PROMPT, PROMPT], ["\n \n", "c b a"])
    assert len(blank) == 2 and blank[0] is None, blank
    within("grpo_process_reward.batched_vs_alone.scores", blank[1], expected[2], label="beside a blank completion",
           scale=1.0)
    assert not reward.fn.model.training and not any(p.requires_grad for p in reward.fn.model.parameters())


def test_a_completion_is_tokenised_as_the_prm_data_phase_tokenised_its_rows(prm, tokenizer):
    """The ids and separator positions of prompt + completion equal those hftrain reward (kind process) trained on
    for the same prompt and steps (step_rows.tokenised_steps), for a conversation and a text prompt."""
    fn = scorer(prm, tokenizer, "last").fn
    for (prompt, completion), steps in zip(CASES, STEPS):
        row = tokenised_steps({"prompt": prompt, "completions": steps, "labels": [True] * len(steps)}, tokenizer,
                              "\n", {})
        assert fn.step_row(prompt, completion) == (row["input_ids"], row["step_ends"])


def test_the_separator_comes_from_the_training_run_or_the_recipe(tmp_path, tokenizer):
    semi = save_prm(tmp_path / "semi", tokenizer, separator=";")
    assert scorer(semi, tokenizer, "min").fn.separator == ";"  # from its recipe.yaml
    bare = save_prm(tmp_path / "bare", tokenizer, separator=None)
    policy = Policy(tokenizer, None, True, ModelSection(name_or_path="p", dtype="float32"))
    spec = RewardSpec(model=bare, aggregate="min", step_separator=";")
    assert load_rewards(GrpoSection(rewards=[spec]), policy=policy)[0].fn.separator == ";"
    with pytest.raises(RewardError, match=r"grpo.rewards.0.step_separator: 'ab c' tokenises to 3 tokens"):
        spec = RewardSpec(model=bare, aggregate="min", step_separator="ab c")
        load_rewards(GrpoSection(rewards=[spec]), policy=policy)


# -- the refusals: `hftrain check` and the run alike -----------------------------------------------------------------
def test_check_and_the_run_refuse_a_process_model_without_aggregate_and_options_without_one(
        tmp_path, prm, tokenizer, tiny_model_dir, capsys):
    from hftrain.cli import main as cli_main
    from hftrain.recipes import grpo

    bare = save_prm(tmp_path / "bare", tokenizer, separator=None)
    one = save_prm(tmp_path / "one", tokenizer, labels=1)
    outcome = save_classifier(tmp_path / "rm", tokenizer)
    rec = grpo_recipe(tmp_path, tiny_model_dir, [
        {"model": bare}, {"model": outcome, "aggregate": "min", "step_separator": "\n"},
        {"function": "exact_match", "aggregate": "last"}, {"model": prm, "aggregate": "min", "step_separator": ";"},
        {"model": one, "aggregate": "last"}, {"model": prm, "aggregate": "mean"}])
    expected = [f"grpo.rewards.0.model: {bare} is a token-classification (process) reward model: it scores each "
                "step, so say how the steps make a completion's reward: set grpo.rewards.0.aggregate to min",
                f"grpo.rewards.0.step_separator: {bare} has no recipe.yaml of a process reward run",
                f"grpo.rewards.1.aggregate: applies to a token-classification (process) reward model; {outcome} is "
                "not one", "grpo.rewards.1.step_separator: applies to a token-classification",
                "grpo.rewards.2.aggregate: applies to a process reward model (`model`), not 'exact_match'",
                f"grpo.rewards.3.step_separator: ';', but {prm} was trained at '\\n'",
                f"grpo.rewards.4.model: {one} is a token classifier with 1 labels; a process reward model has two",
                "grpo.rewards.5.aggregate"]
    for command in (lambda: cli_main(["check", rec]), lambda: grpo.main([rec])):
        with pytest.raises(SystemExit) as e, exit_on_user_error():
            command()
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err, err
        assert all(m in err for m in expected), err
    assert not (tmp_path / "out").exists()


def test_check_and_the_run_refuse_a_separator_of_several_tokens(tmp_path, tokenizer, tiny_model_dir, capsys):
    from hftrain.cli import main as cli_main
    from hftrain.recipes import grpo

    bare = save_prm(tmp_path / "bare", tokenizer, separator=None)
    rec = grpo_recipe(tmp_path, tiny_model_dir, [{"model": bare, "aggregate": "min", "step_separator": "ab c"}])
    for command in (lambda: cli_main(["check", rec]), lambda: grpo.main([rec])):
        with pytest.raises(SystemExit) as e, exit_on_user_error():
            command()
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err, err
        assert "grpo.rewards.0.step_separator: 'ab c' tokenises to 3 tokens" in err, err
    assert not (tmp_path / "out").exists()


# Qwen2's (and Llama 3's) pre-tokeniser pattern: punctuation takes the newlines after it (" ?[^\s\p{L}\p{N}]+[\r\n]*")
GPT4_STYLE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")


def merging_tokenizer(folder):
    """A byte-level BPE trained here with Qwen2's pre-tokeniser: ".\n" is one piece, and one token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(GPT4_STYLE), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    texts = [f"step {w}.\nthen {w} again.\nso {w}.\n" for w in ("one", "two", "three", "four", "five")] * 50
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.save_pretrained(folder)
    return tok


def test_a_separator_a_gpt4_style_pre_tokeniser_merges_is_read_where_it_was_trained(tmp_path):
    """With Qwen2's and Llama 3's pre-tokeniser the default separator "\n" merges with the "." before it (the
    control: the joined text holds no "\n" token at all): training refused such rows, GRPO's scoring read the merged
    token. Both read each step alone and its separator as its own token now: the training row, the rollout's row
    and the PRM's scores at the separators agree."""
    tok = merging_tokenizer(tmp_path / "tok")
    newline, merged = tok.convert_tokens_to_ids("Ċ"), tok.convert_tokens_to_ids(".Ċ")
    joined = tok("step one.\nthen one again.\n", add_special_tokens=False)["input_ids"]
    assert merged in joined and newline not in joined  # the control: no separator token of its own
    steps = ["step one.", "then one again."]
    row = tokenised_steps({"prompt": "so", "completions": steps, "labels": [True, False]}, tok, "\n", {})
    assert [row["input_ids"][i] for i in row["step_ends"]] == [newline, newline]
    prm = save_prm(tmp_path / "prm", tok)
    fn = scorer(prm, tok, "min").fn
    assert fn.step_row("so", "step one.\nthen one again.") == (row["input_ids"], row["step_ends"])
    model = AutoModelForTokenClassification.from_pretrained(prm).eval()
    with torch.no_grad():
        read = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, row["step_ends"]].softmax(-1)[:, 1]
    within("grpo_process_reward.batched_vs_alone.scores", fn(["so"], ["step one.\nthen one again."]),
           [float(read.min())], scale=1.0, label="min over the separators of a merging tokenizer")
