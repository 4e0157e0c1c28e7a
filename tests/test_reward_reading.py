"""How an outcome reward model reads a prompt and its answer (hftrain/methods/reward_reading.py), the one contract its
training and GRPO's scoring import: equal to what TRL's RewardTrainer trains on (its own dataset preparation, called
as the reward method's data phase calls it), for text pairs and conversations; and GRPO's scoring of a policy's own
rollout tokens, completed with what the render writes after an answer, equal to it (a text answer was trained
ending with EOS: a rollout cut short, or a text decoded without its EOS, was scored at the last answer token)."""

import pytest
from datasets import Dataset

from hftrain.config import ModelSection
from hftrain.methods.reward_model import RewardModel
from hftrain.methods.reward.reward_pairs import trl_tokenised
from hftrain.methods.reward_reading import answer_end, completed, outcome_ids
from hftrain.tiny import train_tokenizer

from .test_grpo_reward_model import save_classifier

TEXTS = ["reverse: a b c", " c b a", " a b c", "what is two plus two?", "four", "five"] * 20
TEXT_PAIRS = [{"prompt": "reverse: a b c", "chosen": " c b a", "rejected": " a b c"},
              {"prompt": "reverse: a b c", "chosen": " c b a<|im_end|>", "rejected": " b"}]  # one ends with its EOS
CONVERSATION_PAIRS = [{"prompt": [{"role": "user", "content": "what is two plus two?"}],
                       "chosen": [{"role": "assistant", "content": "four"}],
                       "rejected": [{"role": "assistant", "content": "five"}]}]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXTS, vocab_size=280)


@pytest.mark.parametrize("pairs", [TEXT_PAIRS, CONVERSATION_PAIRS], ids=["text", "conversation"])
def test_an_outcome_reward_model_reads_a_pair_as_trl_trains_it(tokenizer, pairs):
    trained = trl_tokenised(Dataset.from_list(pairs), tokenizer, None, "pairs")
    for row, pair in zip(trained, pairs):
        for side in ("chosen", "rejected"):
            assert outcome_ids(tokenizer, pair["prompt"], pair[side], {}, "k") == row[f"{side}_ids"], (side, pair)


@pytest.mark.parametrize("conversational", [False, True], ids=["text", "conversation"])
def test_a_rollout_of_the_policys_tokens_is_scored_as_its_render(tokenizer, tmp_path, conversational):
    """The same tokenizer: the rollout's own ids, ended at its EOS or cut short, completed as the render ends."""
    folder = save_classifier(tmp_path / "rm", tokenizer)
    model = RewardModel(folder, "grpo.rewards.0.model", tokenizer, None, conversational,
                        ModelSection(name_or_path=folder, dtype="float32"))
    answer = " c b a"
    if conversational:
        prompt = [{"role": "user", "content": "reverse: a b c"}]
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
    else:
        prompt = "reverse: a b c"
        prompt_ids = tokenizer(prompt)["input_ids"]
    rendered = outcome_ids(tokenizer, prompt, answer, {}, "k")
    cut_short = prompt_ids + tokenizer(answer, add_special_tokens=False)["input_ids"]
    ended = cut_short + [tokenizer.eos_token_id]
    for rollout in (cut_short, ended):
        assert completed(rollout, model.answer_end) == rendered
    assert model.answer_end == answer_end(tokenizer, conversational, {}) != []
    assert rendered[-1] == tokenizer.eos_token_id or conversational
    assert model.render([prompt], [answer]) == [rendered]  # another tokenizer's path renders the same way
