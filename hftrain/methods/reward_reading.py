"""How a reward model reads a prompt and its answer, and where its score is: one contract, imported by the reward
trainers' data phases (methods/reward/: reward_pairs.py, step_rows.py) and by GRPO's scoring of rollouts with a
trained reward model (methods/grpo/: reward_model.py, process_reward_model.py), so that what is scored in GRPO is what
was trained.

An outcome reward model (a sequence classifier with one label), as TRL's RewardTrainer renders its training pairs
(trl.trainer.reward_trainer._prepare_dataset; tests/test_reward_reading.py holds the two equal):
- a conversation: the prompt's messages and the answer as an assistant turn (a tool-using rollout: its turns),
  through the chat template, the template writing its own special tokens;
- a text: prompt + answer + the EOS token's text (unless the answer ends with it), encoded with the tokenizer's
  special tokens (a BOS where it adds one);
- its score: the one label's logit at the last token before padding (config.pad_token_id), so rows are padded on the
  right with that id (data/collate.py right_padded), and a tokenizer without a pad token is refused
  (`score_pad_problem`);
- what follows an answer (`answer_end`: the template's turn end, a text's EOS) completes a rollout scored from the
  policy's own tokens, which end at its EOS or where they were cut: read elsewhere, the score is read at a position
  the model was never trained at.

A process reward model (a token classifier with two labels), as TRL's earlier PRMTrainer built its rows:
- the prompt: a text prompt after the tokenizer's BOS, a conversation rendered with the chat template and its
  generation prompt (the template writes its own special tokens), tokenised alone;
- each step: tokenised alone and followed by the separator's one token (the separator encoded alone), the last step
  too; a step's score is read at its separator's token.

Why each step alone and not the joined text: today's pre-tokenisers merge punctuation with the newline after it
(Qwen2's and Llama 3's read ".\\n" as one piece), so in a joined text the default separator "\\n" had no token of its
own after most steps: training refused such rows, and GRPO's scoring silently read whatever merged token held the
separator's last character. Read this way the separator is always its own token, in training and in scoring alike.
A separator that is not one token by itself is refused (`separator_problem`)."""

from __future__ import annotations

from ..data.templates import apply
from ..errors import DataError


def separator_ids(tokenizer, separator: str) -> list[int]:
    return tokenizer.encode(separator, add_special_tokens=False)


def separator_problem(tokenizer, separator: str) -> str | None:
    """Why `separator` cannot mark a step's end with this tokenizer (it is not one token by itself), or None."""
    ids = separator_ids(tokenizer, separator)
    if len(ids) != 1:
        return (f"{separator!r} tokenises to {len(ids)} tokens {tokenizer.convert_ids_to_tokens(ids)}, so a step's "
                "end has no one token to carry its label: choose a separator that is a single token (e.g. '\\n')")
    return None


def steps_of(text: str, separator: str) -> list[str]:
    """The steps of a rollout's text: the pieces between separators, blank ones left out (a training row never has
    an empty step)."""
    return [step for step in text.split(separator) if step.strip()]


def prompt_ids(prompt, tokenizer, template_kwargs: dict) -> list[int]:
    """The prompt's ids (the module docstring); a template that refuses it is a DataError."""
    if isinstance(prompt, str):
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        return bos + tokenizer.encode(prompt, add_special_tokens=False)
    try:
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **template_kwargs)
    except Exception as e:  # noqa: BLE001 - the template's own refusal (jinja raise_exception)
        raise DataError(f"the chat template refuses the prompt: {type(e).__name__}: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def step_row(prompt, steps: list[str], tokenizer, separator: str, template_kwargs: dict) -> dict:
    """{input_ids, prompt_tokens, step_ends}: the prompt's ids, then each step's followed by the separator's token;
    step_ends the index of each step's separator token."""
    (sep,) = separator_ids(tokenizer, separator)  # separator_problem refused any other
    ids = prompt_ids(prompt, tokenizer, template_kwargs)
    first, ends = len(ids), []
    for step in steps:
        ids += tokenizer.encode(step, add_special_tokens=False) + [sep]
        ends.append(len(ids) - 1)
    return {"input_ids": ids, "prompt_tokens": first, "step_ends": ends}


# An outcome reward model.

ANSWER = "\x00answer\x00"  # a text no chat template writes, to find where the answer ends in a rendered turn


def outcome_ids(tokenizer, prompt, answer, template_kwargs: dict, key: str) -> list[int]:
    """prompt + answer as an outcome reward model reads them (the module docstring); a template that refuses the
    conversation is a DataError naming `key`."""
    if isinstance(prompt, list):
        turns = answer if isinstance(answer, list) else [{"role": "assistant", "content": answer}]
        text = apply(tokenizer, prompt + turns, None, template_kwargs, key, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token or ""
    return tokenizer(prompt + answer + ("" if answer.endswith(eos) else eos))["input_ids"]


def answer_end(tokenizer, conversational: bool, template_kwargs: dict) -> list[int]:
    """The tokens the render writes after an answer's text: a text's EOS; the chat template's end of the assistant
    turn (Qwen's `<|im_end|>` `\\n`), none when the template does not show the answer as given."""
    if not conversational:
        return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": ANSWER}]
    try:
        text = apply(tokenizer, turns, None, template_kwargs, "answer_end", tokenize=False)
    except DataError:  # a template that refuses this probe: the rollouts are scored as they are
        return []
    if not isinstance(text, str) or text.count(ANSWER) != 1:
        return []
    return tokenizer(text.split(ANSWER)[1], add_special_tokens=False)["input_ids"]


def completed(rollout: list[int], end: list[int]) -> list[int]:
    """`rollout` with the part of `end` (answer_end) it lacks: after an EOS that begins `end`, the rest of it; after a
    completion cut short, all of it (as the render writes a truncated answer)."""
    have = next((k for k in range(len(end), 0, -1) if rollout[-k:] == end[:k]), 0)
    return list(rollout) + end[have:]


def score_pad_problem(tokenizer, key: str) -> str | None:
    """Why a sequence classifier could not find the last real token of a padded row with this tokenizer (hftrain's
    tokenizer pads with EOS, or UNK, when it has no pad token: modeling.load_tokenizer), or None."""
    if tokenizer.pad_token_id is None:
        return (f"{key}: the tokenizer has no pad, eos or unk token, so a sequence classifier "
                "cannot find the last real token of a padded row (config.pad_token_id): add a pad token to the "
                "tokenizer (tokenizer.add_special_tokens({'pad_token': ...})) and save it again")
    return None
